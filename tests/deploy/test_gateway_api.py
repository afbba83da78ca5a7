"""Offline checks of ``deploy/gateway-api`` (kvrouter as an InferencePool's Endpoint Picker) and of
``deploy/envoy/envoy.yaml``: the manifests render and validate, and agree with each other, with the vLLM
pods of ``deploy/k8s/base`` and with kvrouter's command line; Envoy's own ``--mode validate`` accepts the
Envoy file."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from kvrouter.cli import build_parser
from kvrouter.config import load_router_fleet
from tests.support.envoy import ENVOY_YAML, envoy_binary

ROOT = Path(__file__).resolve().parents[2]
TREE = ROOT / "deploy" / "gateway-api"
BASE = ROOT / "deploy" / "k8s" / "base"
K8S_VERSIONS = ("1.29", kubernetes_validate.latest_version())


def _render(path: Path) -> list[dict[str, Any]]:
    proc = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    return _render(TREE)


def _one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, kind
    return found[0]


def test_core_kinds_validate_and_custom_kinds_use_known_fields(docs: list[dict[str, Any]]) -> None:
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(
        [
            "ConfigMap",
            "Deployment",
            "HTTPRoute",
            "InferencePool",
            "Role",
            "RoleBinding",
            "Service",
            "ServiceAccount",
        ]
    )
    for doc in docs:
        if doc["kind"] in ("InferencePool", "HTTPRoute"):
            continue
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)
    pool = _one(docs, "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert set(pool["spec"]) <= {"selector", "targetPorts", "endpointPickerRef", "appProtocol"}
    ref = pool["spec"]["endpointPickerRef"]
    assert set(ref) <= {"group", "kind", "name", "port", "failureMode"}
    assert ref["failureMode"] in ("FailOpen", "FailClose")
    route = _one(docs, "HTTPRoute")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert set(route["spec"]) <= {"parentRefs", "hostnames", "rules"}


def test_pool_picker_service_and_container_agree(docs: list[dict[str, Any]], tmp_path: Path) -> None:
    pool = _one(docs, "InferencePool")
    ref = pool["spec"]["endpointPickerRef"]
    svc = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == ref["name"])
    grpc_port = next(p for p in svc["spec"]["ports"] if p["port"] == ref["port"]["number"])
    assert grpc_port["appProtocol"] == "kubernetes.io/h2c"  # gRPC without TLS inside the cluster
    dep = _one(docs, "Deployment")
    pod = dep["spec"]["template"]
    assert all(pod["metadata"]["labels"].get(k) == v for k, v in svc["spec"]["selector"].items())
    c = next(c for c in pod["spec"]["containers"] if c["name"] == "epp")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports[grpc_port["targetPort"]] == ref["port"]["number"]
    args = build_parser(c["args"]).parse_args(c["args"])
    assert args.command == "epp" and args.grpc_port == ref["port"]["number"] and args.host == "0.0.0.0"
    assert {c[k]["grpc"]["service"] for k in ("livenessProbe", "readinessProbe")} == {"liveness", "readiness"}
    assert all(c[k]["grpc"]["port"] == args.grpc_port for k in ("livenessProbe", "readinessProbe"))
    # the fleet file the pod mounts is a valid one, discovering the pods of this InferencePool
    cm = _one(docs, "ConfigMap")
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(cm["data"]["fleet.yaml"])
    cfg = load_router_fleet(fleet)
    assert cfg.discovery is not None and not cfg.instances
    assert cfg.discovery.pool == pool["metadata"]["name"] and cfg.discovery.service is None
    vol = next(v for v in pod["spec"]["volumes"] if v["name"] == "fleet")
    assert vol["configMap"]["name"] == cm["metadata"]["name"]
    assert args.fleet == "/etc/kvrouter/fleet.yaml"
    # ... which are the vLLM pods of deploy/k8s: selected by their labels, served on their http port,
    # publishing on the container ports the fleet file names
    base = _render(BASE)
    sts = next(d for d in base if d["kind"] == "StatefulSet")
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in pool["spec"]["selector"]["matchLabels"].items())
    engine = sts["spec"]["template"]["spec"]["containers"][0]
    named = {p["name"]: p["containerPort"] for p in engine["ports"]}
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [named["http"]]
    assert {cfg.discovery.events_port, cfg.discovery.replay_port} <= set(named)


def test_rbac_and_route(docs: list[dict[str, Any]]) -> None:
    role = _one(docs, "Role")
    grants = {
        (g, r): set(rule["verbs"])
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
    }
    assert grants[("inference.networking.k8s.io", "inferencepools")] >= {"list", "watch"}
    assert grants[("", "pods")] >= {"list", "watch"}  # what pool discovery asks the API server
    assert all(v in ("get", "list", "watch") for vs in grants.values() for v in vs), "read-only"
    binding = _one(docs, "RoleBinding")
    sa = _one(docs, "ServiceAccount")
    assert (
        binding["subjects"][0]["name"]
        == sa["metadata"]["name"]
        == _one(docs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"]
    )
    route = _one(docs, "HTTPRoute")
    (backend,) = route["spec"]["rules"][0]["backendRefs"]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io",
        "InferencePool",
        _one(docs, "InferencePool")["metadata"]["name"],
    )


def test_envoy_config_is_what_the_protocol_needs() -> None:
    cfg = yaml.safe_load(ENVOY_YAML.read_text())
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    filters = [f["name"] for f in hcm["http_filters"]]
    assert filters == [
        "envoy.filters.http.ext_proc",
        "envoy.filters.http.header_to_metadata",
        "envoy.filters.http.router",
    ]
    ext = hcm["http_filters"][0]["typed_config"]
    mode = ext["processing_mode"]
    assert mode["request_body_mode"] == mode["response_body_mode"] == "FULL_DUPLEX_STREAMED"
    assert {"envoy.lb", "envoy.lb.subset_hint"} <= set(
        ext["metadata_options"]["forwarding_namespaces"]["untyped"]
    )
    pool = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "pool")
    assert pool["type"] == "ORIGINAL_DST"
    assert pool["original_dst_lb_config"]["http_header_name"] == "x-gateway-destination-endpoint"


@pytest.mark.skipif(envoy_binary() is None, reason="envoy not installed (make install)")
def test_envoy_validates_its_config() -> None:
    proc = subprocess.run(
        [str(envoy_binary()), "--mode", "validate", "-c", str(ENVOY_YAML), "--disable-hot-restart"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
