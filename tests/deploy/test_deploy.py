"""Offline checks of ``deploy/``: the files parse, validate, and agree with each other and with kvrouter.

    deploy/Dockerfile ──── structure (stages, non-root USER, EXPOSE, ENTRYPOINT/CMD parsed by kvrouter's CLI)
    deploy/compose/ ────── vLLM flags ⇄ fleet.yaml (ports, topics, block size, model) ⇄ Prometheus targets
    deploy/k8s/ ───────── every overlay rendered by kustomize, validated against the Kubernetes schemas
                           (kubernetes-validate, strict), then vLLM pods ⇄ the fleet ConfigMap ⇄ router
    deploy/grafana/ ────── every metric a panel queries is one kvrouter (or vLLM) exports

Kustomize comes from ``kubectl kustomize`` (the machine image ships kubectl) or a ``kustomize`` binary; no
network, no cluster, no Docker engine.  The metric names are read from the code's own collectors, so the
``_total``/``_bucket`` suffixes are the ones Prometheus will actually see.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml
import zmq.asyncio

from indexer import Indexer
from indexer.config import FleetConfig, InstanceConfig
from indexer.metrics import IndexerCollector
from indexer.subscriber import EventSubscriber
from kvrouter.cli import COMMANDS
from kvrouter.config import RouterFleetConfig, load_router_fleet
from kvrouter.flows import LocalAccounts
from kvrouter.gateway.metrics import GatewayMetrics
from kvrouter.pipeline.metrics import FlowAccountsCollector
from kvrouter.replicas.metrics import SharedStateMetrics
from kvrouter.telemetry import AccessLogConfig, Telemetry, TracingConfig
from kvrouter.telemetry.export import SpanSink
from kvrouter.telemetry.metrics import TelemetryCollector

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE_DIR = DEPLOY / "compose"
K8S = DEPLOY / "k8s"
DASHBOARD = DEPLOY / "grafana" / "kvrouter-dashboard.json"

# The oldest Kubernetes minor the manifests claim to support, and the newest schema the package bundles.
K8S_VERSIONS = ("1.29", kubernetes_validate.latest_version())

# vLLM's --kv-events-config fields (vllm/config/kv_events.py, KVEventsConfig).
KV_EVENTS_FIELDS = {
    "enable_kv_cache_events",
    "publisher",
    "endpoint",
    "replay_endpoint",
    "buffer_steps",
    "hwm",
    "max_queue_size",
    "topic",
}
# The `vllm serve` flags deploy/ uses: a typo (--enable-prompt-token-details) would otherwise pass.
VLLM_FLAGS = {
    "--model",
    "--served-model-name",
    "--host",
    "--port",
    "--block-size",
    "--enable-prefix-caching",
    "--enable-prompt-tokens-details",
    "--kv-events-config",
    "--max-model-len",
    "--gpu-memory-utilization",
    "--tensor-parallel-size",
    "--data-parallel-size",
}
# vLLM's Prometheus names the dashboard may query (labels model_name, engine).
VLLM_METRICS = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
}
# Metric families the dashboard must show (the brief of issue 7's deploy/ section).
REQUIRED_FAMILIES = {
    "kvrouter_requests",
    "kvrouter_decisions",
    "kvrouter_routing_decision_seconds",
    "kvrouter_predicted_cached_tokens",
    "kvrouter_reported_cached_tokens",
    "kvrouter_instance_in_flight",
    "kvrouter_instance_healthy",
    "kvrouter_retries",
    "kvrouter_spills",
    "kvrouter_rejections",
    "kvrouter_queue_depth",
    "kvrouter_shadow_cached_tokens",
    "kvrouter_shadow_agreement",
    "kvrouter_indexer_batches",
    "kvrouter_indexer_events",
    "kvrouter_indexer_decode_errors",
    "kvrouter_indexer_source_trust",
    "kvrouter_indexer_source_lag_seconds",
    "kvrouter_indexer_index_entries",
}


# ---------------------------------------------------------------------------------------------- helpers
def _flag(args: list[str], name: str) -> str | None:
    """The value of ``--name value`` or ``--name=value`` in an argv, or None if absent."""
    for i, a in enumerate(args):
        if a == name:
            return args[i + 1] if i + 1 < len(args) else ""
        if a.startswith(name + "="):
            return a[len(name) + 1 :]
    return None


def _has_flag(args: list[str], name: str) -> bool:
    return any(a == name or a.startswith(name + "=") for a in args)


def _flag_names(args: list[str]) -> set[str]:
    return {a.split("=", 1)[0] for a in args if a.startswith("--")}


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def _host(url_or_endpoint: str) -> str:
    host = urlsplit(url_or_endpoint).hostname
    assert host is not None, url_or_endpoint
    return host


def _kv_events(args: list[str]) -> dict[str, Any]:
    raw = _flag(args, "--kv-events-config")
    assert raw, f"no --kv-events-config in {args}"
    cfg = json.loads(raw)
    assert isinstance(cfg, dict)
    assert set(cfg) <= KV_EVENTS_FIELDS, f"unknown --kv-events-config fields: {set(cfg) - KV_EVENTS_FIELDS}"
    assert cfg["enable_kv_cache_events"] is True
    assert cfg["publisher"] == "zmq", "publisher must be explicit on vLLM <= 0.11"
    for key in ("endpoint", "replay_endpoint"):
        # vLLM binds when the endpoint has a wildcard: kvrouter then connects (connect mode).
        assert re.fullmatch(r"tcp://\*:\d+", cfg[key]), f"{key} {cfg[key]!r}: expected tcp://*:PORT"
    return cfg


def _check_vllm_args(args: list[str], fleet: RouterFleetConfig, inst: InstanceConfig) -> dict[str, Any]:
    """One vLLM argv against the fleet file's view of that instance; returns its --kv-events-config."""
    assert _flag_names(args) <= VLLM_FLAGS, f"unexpected vLLM flags: {_flag_names(args) - VLLM_FLAGS}"
    assert _has_flag(args, "--enable-prefix-caching")
    assert _has_flag(args, "--enable-prompt-tokens-details"), "cached_tokens is the router's ground truth"
    assert int(_flag(args, "--block-size") or 0) == fleet.block_size
    cfg = _kv_events(args)
    assert inst.events is not None and inst.replay is not None and inst.url is not None
    assert _port(inst.events) == _port(cfg["endpoint"])
    assert _port(inst.replay) == _port(cfg["replay_endpoint"])
    assert _port(inst.url) == int(_flag(args, "--port") or 8000)
    assert inst.topic == cfg.get("topic", ""), (
        f"{inst.name}: fleet topic {inst.topic!r} != {cfg.get('topic')}"
    )
    served = _flag(args, "--served-model-name") or _flag(args, "--model")
    assert served in fleet.models, f"served model {served!r} not in the fleet's models {list(fleet.models)}"
    assert fleet.tokenizer_for(served) == _flag(args, "--model"), "the router's tokenizer is vLLM's model"
    return cfg


def _parse_kvrouter(argv: list[str]) -> argparse.Namespace:
    """Parse ``kvrouter COMMAND ...`` with the command's own argument parser (fails on unknown flags)."""
    assert argv and argv[0] in COMMANDS, f"not a kvrouter command: {argv}"
    module = importlib.import_module(COMMANDS[argv[0]][0])
    parser = argparse.ArgumentParser(prog=f"kvrouter {argv[0]}")
    module.add_arguments(parser)
    ns, unknown = parser.parse_known_args(argv[1:])
    assert not unknown, f"kvrouter {argv[0]} does not take {unknown}"
    return ns


class _NoSender:
    def send(self, payload: bytes) -> bool:
        return True

    def shutdown(self) -> None:
        pass


def _exported_metrics() -> dict[str, set[str]]:
    """Family name -> the sample names Prometheus stores, from the gateway's and indexer's collectors."""
    m = GatewayMetrics()
    ctx = zmq.asyncio.Context()  # the subscriber's transport family exists only with a subscriber
    try:
        ix = Indexer(16)
        m.registry.register(IndexerCollector(ix, EventSubscriber(ix, FleetConfig(), ctx=ctx)))
        SharedStateMetrics(m.registry)  # with replicas sharing through Redis
        sink = SpanSink(TracingConfig(enabled=True), _NoSender())  # with tracing and the access log on
        m.registry.register(
            TelemetryCollector(
                Telemetry(TracingConfig(enabled=True), AccessLogConfig(enabled=True), sink=sink)
            )
        )
        m.registry.register(FlowAccountsCollector(LocalAccounts()))
        families = list(m.registry.collect())
        sink.shutdown()
    finally:
        ctx.term()
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "gauge": ("",),
    }
    return {f.name: {f.name + s for s in suffixes[f.type]} for f in families}


def _write_fleet(tmp_path: Path, text: str) -> RouterFleetConfig:
    p = tmp_path / "fleet.yaml"
    p.write_text(text)
    return load_router_fleet(p)


# ------------------------------------------------------------------------------------------- fleet files
@pytest.mark.parametrize("path", sorted(DEPLOY.rglob("fleet.yaml")), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_fleet_files_load(path: Path) -> None:
    fleet = load_router_fleet(path)
    assert fleet.instances or fleet.discovery is not None, "a deploy fleet names or discovers its instances"
    for inst in fleet.instances:
        assert inst.url and inst.events and inst.replay, f"{inst.name}: url, events and replay are all wired"
        # Rank r of a data-parallel instance publishes on port + r (replay likewise): the ranges of the
        # HTTP, event and replay ports must stay apart.
        ranges = [
            range(_port(inst.events), _port(inst.events) + inst.dp_size),
            range(_port(inst.replay), _port(inst.replay) + inst.dp_size),
            range(_port(inst.url), _port(inst.url) + 1),
        ]
        ports = [p for r in ranges for p in r]
        assert len(ports) == len(set(ports)), f"{inst.name}: port ranges overlap: {ranges}"


def test_fleet_files_are_found() -> None:
    found = {p.relative_to(DEPLOY).as_posix() for p in DEPLOY.rglob("fleet.yaml")}
    assert {"compose/fleet.yaml", "k8s/base/fleet.yaml", "k8s/overlays/prod/fleet.yaml"} <= found


# ---------------------------------------------------------------------------------------------- Dockerfile
def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments and parser directives dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for line in (DEPLOY / "Dockerfile").read_text().splitlines():
        s = line.strip()
        if not buf and (not s or s.startswith("#")):
            continue
        if s.startswith("#"):
            continue
        if s.endswith("\\"):
            buf += s[:-1] + " "
            continue
        buf += s
        instr, _, rest = buf.partition(" ")
        out.append((instr.upper(), rest.strip()))
        buf = ""
    assert not buf, "dangling line continuation"
    return out


def test_dockerfile_structure() -> None:
    ins = _dockerfile()
    stages = [i for i, (k, _) in enumerate(ins) if k == "FROM"]
    assert len(stages) >= 2, "a build stage and a slim runtime stage"
    froms = [ins[i][1] for i in stages]
    assert all(re.search(r"\bAS \w+", f, re.I) for f in froms), f"every stage is named: {froms}"
    args = dict(a.split("=", 1) for k, a in ins if k == "ARG" and "=" in a)
    base = args.get("PYTHON_IMAGE", froms[-1].split()[0])
    assert re.fullmatch(r"python:3\.11-slim(-\w+)?", base), base
    final = ins[stages[-1] :]
    kinds = [k for k, _ in final]
    for needed in ("USER", "EXPOSE", "ENTRYPOINT", "CMD", "HEALTHCHECK"):
        assert needed in kinds, f"the runtime stage has no {needed}"
    user = [a for k, a in final if k == "USER"][-1]
    assert user.split(":")[0] not in ("root", "0"), "runs as a non-root user"
    exposed = {int(p.split("/")[0]) for k, a in final if k == "EXPOSE" for p in a.split()}
    assert {8080, 8081} <= exposed
    entry = json.loads([a for k, a in final if k == "ENTRYPOINT"][-1])
    cmd = json.loads([a for k, a in final if k == "CMD"][-1])
    assert entry == ["kvrouter"]
    assert cmd == ["serve", "--fleet", "/etc/kvrouter/fleet.yaml", "--host", "0.0.0.0"]
    ns = _parse_kvrouter(cmd)
    assert ns.host == "0.0.0.0" and ns.port in exposed
    health = [a for k, a in final if k == "HEALTHCHECK"][-1]
    assert "/health" in health and str(ns.port) in health
    # Only the build stage compiles; the runtime stage copies the virtualenv.
    assert any(k == "COPY" and a.startswith("--from=") for k, a in final)
    assert not any(k == "RUN" and "build-essential" in a for k, a in final)


def test_dockerfile_copies_what_the_package_needs() -> None:
    """Every COPY source exists and is not ignored; every package pyproject builds is copied."""
    copied: set[str] = set()
    for k, a in _dockerfile():
        if k != "COPY" or a.startswith("--from="):
            continue
        *srcs, _dest = a.split()
        for src in srcs:
            assert (ROOT / src).exists(), f"COPY {src}: no such path in the build context"
            copied.add(src.rstrip("/"))
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages <= copied, f"packages not copied into the image: {packages - copied}"
    assert pyproject["project"]["readme"] in copied
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert not copied & ignored, f".dockerignore drops what the image copies: {copied & ignored}"
    assert {".git", ".venv", "tests"} <= ignored


# ------------------------------------------------------------------------------------------------ Compose
def _interpolate(value: Any) -> Any:
    """Compose's ``${VAR:-default}`` / ``${VAR-default}`` / ``${VAR}`` with an empty environment."""
    if isinstance(value, str):
        return re.sub(r"\$\{\w+(?::?-([^}]*))?\}", lambda m: m.group(1) or "", value)
    if isinstance(value, list):
        return [_interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: _interpolate(v) for k, v in value.items()}
    return value


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    doc = yaml.safe_load((COMPOSE_DIR / "compose.yaml").read_text())
    assert isinstance(doc, dict)
    assert "version" not in doc, "the Compose spec has no version field (it only warns)"
    return dict(_interpolate(doc))


def _vllm_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in compose["services"].items() if str(s.get("image", "")).startswith("vllm/")}


def _bind_mounts(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> host path of the service's bind mounts (named volumes left out)."""
    out = {}
    for v in service.get("volumes", []):
        src, dst = v.split(":")[:2]
        if src.startswith((".", "/")):
            out[dst] = src
    return out


def test_compose_structure(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {"kvrouter", "prometheus", "grafana"} <= set(services)
    vllm = _vllm_services(compose)
    assert len(vllm) >= 2
    gpus: list[str] = []
    for name, svc in vllm.items():
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert all("gpu" in d["capabilities"] and d["driver"] == "nvidia" for d in devices), name
        gpus += [g for d in devices for g in d.get("device_ids", [])]
        # vLLM's ports stay on the Compose network: the event stream carries cache_salt in plain text.
        assert not svc.get("ports"), f"{name} publishes ports on the host"
        assert {"8000", "5557", "5558"} <= {str(p) for p in svc.get("expose", [])}
        assert svc.get("ipc") == "host" or svc.get("shm_size"), f"{name}: PyTorch needs shared memory"
    assert len(gpus) == len(set(gpus)), f"two vLLM containers share a GPU: {gpus}"
    for name, svc in services.items():
        for dst, src in _bind_mounts(svc).items():
            assert (COMPOSE_DIR / src).exists(), f"{name}: bind mount {src} -> {dst} does not exist"
    named = {v.split(":")[0] for s in services.values() for v in s.get("volumes", [])}
    declared = set(compose.get("volumes") or {})
    assert {n for n in named if not n.startswith((".", "/"))} <= declared


def test_compose_vllm_flags_match_fleet(compose: dict[str, Any]) -> None:
    fleet = load_router_fleet(COMPOSE_DIR / "fleet.yaml")
    vllm = _vllm_services(compose)
    assert {i.name for i in fleet.instances} == set(vllm), "one fleet instance per vLLM service"
    for inst in fleet.instances:
        args = [str(a) for a in vllm[inst.name]["command"]]
        _check_vllm_args(args, fleet, inst)
        # The instance is reached by its service name on the Compose network.
        assert inst.url is not None and inst.events is not None and inst.replay is not None
        assert {_host(inst.url), _host(inst.events), _host(inst.replay)} == {inst.name}


def test_compose_router(compose: dict[str, Any]) -> None:
    svc = compose["services"]["kvrouter"]
    ns = _parse_kvrouter([str(a) for a in svc["command"]])
    assert ns.host == "0.0.0.0"
    mounts = _bind_mounts(svc)
    assert mounts.get(ns.fleet) == "./fleet.yaml", "the mounted fleet file is the one the router reads"
    assert f"{ns.port}:{ns.port}" in [str(p) for p in svc["ports"]]
    build = svc["build"]
    assert (COMPOSE_DIR / build["context"] / build["dockerfile"]).resolve() == DEPLOY / "Dockerfile"
    assert set(svc.get("depends_on", {})) == set(_vllm_services(compose))


def test_compose_monitoring(compose: dict[str, Any]) -> None:
    prom_svc = compose["services"]["prometheus"]
    config_host = next(src for dst, src in _bind_mounts(prom_svc).items() if dst.endswith("prometheus.yml"))
    prom = yaml.safe_load((COMPOSE_DIR / config_host).read_text())
    targets = {
        job["job_name"]: {t for sc in job["static_configs"] for t in sc["targets"]}
        for job in prom["scrape_configs"]
    }
    router = _parse_kvrouter([str(a) for a in compose["services"]["kvrouter"]["command"]])
    assert f"kvrouter:{router.port}" in targets["kvrouter"]
    fleet = load_router_fleet(COMPOSE_DIR / "fleet.yaml")
    assert targets["vllm"] == {urlsplit(i.url or "").netloc for i in fleet.instances}

    graf = compose["services"]["grafana"]
    mounts = _bind_mounts(graf)
    dash_dst = next(dst for dst, src in mounts.items() if src.endswith("kvrouter-dashboard.json"))
    assert (COMPOSE_DIR / mounts[dash_dst]).resolve() == DASHBOARD
    providers_src = next(src for dst, src in mounts.items() if "/provisioning/dashboards/" in dst)
    providers = yaml.safe_load((COMPOSE_DIR / providers_src).read_text())["providers"]
    assert any(dash_dst.startswith(p["options"]["path"].rstrip("/") + "/") for p in providers)
    ds_src = next(src for dst, src in mounts.items() if "/provisioning/datasources/" in dst)
    ds = yaml.safe_load((COMPOSE_DIR / ds_src).read_text())["datasources"]
    assert [d["url"] for d in ds if d["type"] == "prometheus"] == ["http://prometheus:9090"]


# ------------------------------------------------------------------------------------------- Kubernetes
def _kustomize() -> list[str]:
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    pytest.fail("rendering deploy/k8s needs `kubectl` (apt package kubectl) or a `kustomize` binary on PATH")


K8S_TREES = ["base", *sorted(p.parent.name for p in (K8S / "overlays").glob("*/kustomization.yaml"))]


@pytest.fixture(scope="module", params=K8S_TREES)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    name = str(request.param)
    path = K8S / "base" if name == "base" else K8S / "overlays" / name
    proc = subprocess.run([*_kustomize(), str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert not proc.stderr.strip(), f"kustomize warned: {proc.stderr}"
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    return name, docs


def _one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def _kinds(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _container(pod_spec: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in pod_spec["containers"] if c["name"] == name)


def _named_ports(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def _check_service_monitor(sm: dict[str, Any]) -> None:
    """monitoring.coreos.com/v1 ServiceMonitor: the fields used here, typed (no CRD schema is bundled)."""
    assert set(sm) <= {"apiVersion", "kind", "metadata", "spec"}
    spec = sm["spec"]
    assert set(spec) <= {"selector", "endpoints", "namespaceSelector", "jobLabel", "targetLabels"}
    assert isinstance(spec["selector"]["matchLabels"], dict) and spec["selector"]["matchLabels"]
    for ep in spec["endpoints"]:
        assert set(ep) <= {"port", "path", "interval", "scrapeTimeout", "scheme", "honorLabels"}
        assert isinstance(ep["port"], str) and ep["path"].startswith("/")
        for key in ("interval", "scrapeTimeout"):
            assert key not in ep or re.fullmatch(r"\d+(ms|s|m)", ep[key]), ep


def test_k8s_schemas(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = rendered
    assert docs
    for doc in docs:
        what = f"{name}: {doc['kind']}/{doc['metadata']['name']}"
        if doc["apiVersion"] == "monitoring.coreos.com/v1":
            assert doc["kind"] == "ServiceMonitor", what
            _check_service_monitor(doc)
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                path = ".".join(str(p) for p in e.path)
                pytest.fail(f"{what} invalid against Kubernetes {version}: {path}: {e.message}")
            except kubernetes_validate.SchemaNotFoundError as e:
                pytest.fail(f"{what}: {e.message}")
    if name != "base":
        namespaces = {d["metadata"]["name"] for d in _kinds(docs, "Namespace")}
        assert len(namespaces) == 1
        others = [d for d in docs if d["kind"] != "Namespace"]
        assert all(d["metadata"].get("namespace") in namespaces for d in others)


def test_k8s_fleet_matches_vllm(rendered: tuple[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    """The fleet ConfigMap names each StatefulSet pod by its DNS name, with the pod's ports and flags."""
    _, docs = rendered
    fleet_cm = [d for d in _kinds(docs, "ConfigMap") if d["metadata"]["name"].startswith("kvrouter-fleet")]
    assert len(fleet_cm) == 1
    fleet = _write_fleet(tmp_path, fleet_cm[0]["data"]["fleet.yaml"])
    sts = _one(docs, "StatefulSet", "vllm")
    svc = _one(docs, "Service", sts["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None", "pods get DNS names only through a headless Service"
    pod = sts["spec"]["template"]
    container = _container(pod["spec"], "vllm")
    ports = _named_ports(container)
    assert ports == {"http": 8000, "kv-events": 5557, "kv-replay": 5558}
    assert {p["name"]: p["targetPort"] for p in svc["spec"]["ports"]} == {n: n for n in ports}
    assert len(fleet.instances) == sts["spec"]["replicas"], "one fleet instance per vLLM pod"
    # Kubernetes discovery reads the data-parallel size from this Service label (copied onto its slices).
    dp_size = int(svc["metadata"]["labels"]["kvrouter.io/dp-size"])
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    base_name, svc_name = sts["metadata"]["name"], svc["metadata"]["name"]
    for i, inst in enumerate(fleet.instances):
        pod_name = f"{base_name}-{i}"
        host = f"{pod_name}.{svc_name}"
        # kubelet expands $(POD_NAME) in args from the container's env.
        args = [a.replace("$(POD_NAME)", pod_name) for a in container["args"]]
        assert inst.name == pod_name
        assert inst.url == f"http://{host}:{ports['http']}"
        assert inst.events == f"tcp://{host}:{ports['kv-events']}"
        assert inst.replay == f"tcp://{host}:{ports['kv-replay']}"
        assert inst.dp_size == dp_size
        cfg = _check_vllm_args(args, fleet, inst)
        assert (
            _port(cfg["endpoint"]) == ports["kv-events"]
            and _port(cfg["replay_endpoint"]) == ports["kv-replay"]
        )
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_k8s_router(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    dep = _one(docs, "Deployment", "kvrouter")
    spec = dep["spec"]["template"]["spec"]
    c = _container(spec, "kvrouter")
    ns = _parse_kvrouter(c["args"])
    assert ns.host == "0.0.0.0"
    assert _named_ports(c) == {"http": ns.port}
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["livenessProbe"]["httpGet"]["path"] in ("/health", "/ping", "/metrics")
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    # The fleet file it reads comes from the fleet ConfigMap.
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    mount_dir = str(Path(ns.fleet).parent)
    volumes = {v["name"]: v for v in spec["volumes"]}
    cm_name = volumes[mounts[mount_dir]]["configMap"]["name"]
    assert Path(ns.fleet).name in _one(docs, "ConfigMap", cm_name)["data"]
    # Non-root, as the image.
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0
    # The init step that fetches tokenizers is valid Python reading the same file.
    for init in spec.get("initContainers", []):
        script = init["command"][-1]
        compile(script, init["name"], "exec")
        assert ns.fleet in script
    svc = _one(docs, "Service", "kvrouter")
    assert {p["name"]: p["targetPort"] for p in svc["spec"]["ports"]} == {"http": "http"}
    pdb = _one(docs, "PodDisruptionBudget", "kvrouter")
    assert _matches(pdb["spec"]["selector"]["matchLabels"], dep["spec"]["template"]["metadata"]["labels"])
    assert "maxUnavailable" in pdb["spec"] or pdb["spec"]["minAvailable"] < dep["spec"]["replicas"]


def test_k8s_discovery_rbac(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = rendered
    dep = _one(docs, "Deployment", "kvrouter")
    sa = dep["spec"]["template"]["spec"]["serviceAccountName"]
    _one(docs, "ServiceAccount", sa)
    bindings = [
        b
        for b in _kinds(docs, "RoleBinding")
        if any(s["kind"] == "ServiceAccount" and s["name"] == sa for s in b["subjects"])
    ]
    assert bindings, f"no RoleBinding for ServiceAccount {sa}"
    rules = [r for b in bindings for r in _one(docs, "Role", b["roleRef"]["name"])["rules"]]
    grants = {
        (g, res, v) for r in rules for g in r["apiGroups"] for res in r["resources"] for v in r["verbs"]
    }
    assert {("discovery.k8s.io", "endpointslices", v) for v in ("get", "list", "watch")} <= grants
    assert all(v in ("get", "list", "watch") for *_, v in grants), "discovery is read-only"
    if name != "base":
        ns = dep["metadata"]["namespace"]
        assert all(s.get("namespace") == ns for b in bindings for s in b["subjects"])


def test_k8s_selectors_and_named_ports(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    """What schemas cannot see: selectors that select something, and port names that exist."""
    _, docs = rendered
    workloads = _kinds(docs, "Deployment") + _kinds(docs, "StatefulSet")
    pods = [w["spec"]["template"] for w in workloads]
    for w in workloads:
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert _matches(w["spec"]["selector"]["matchLabels"], labels), w["metadata"]["name"]
        for c in w["spec"]["template"]["spec"]["containers"]:
            named = _named_ports(c)
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                port = next(
                    (v["port"] for k, v in c.get(probe, {}).items() if k in ("httpGet", "tcpSocket")), 0
                )
                assert not isinstance(port, str) or port in named, f"{c['name']} {probe}: no port {port!r}"
    for svc in _kinds(docs, "Service"):
        sel = svc["spec"]["selector"]
        targets = [p for p in pods if _matches(sel, p["metadata"]["labels"])]
        assert targets, f"Service {svc['metadata']['name']} selects no pod"
        for port in svc["spec"]["ports"]:
            tp = port["targetPort"]
            assert all(
                tp in {n for c in p["spec"]["containers"] for n in _named_ports(c)} for p in targets
            ), f"Service {svc['metadata']['name']}: targetPort {tp!r} not on its pods"
    for pdb in _kinds(docs, "PodDisruptionBudget"):
        assert any(_matches(pdb["spec"]["selector"]["matchLabels"], p["metadata"]["labels"]) for p in pods)
    for sm in _kinds(docs, "ServiceMonitor"):
        sel = sm["spec"]["selector"]["matchLabels"]
        services = [s for s in _kinds(docs, "Service") if _matches(sel, s["metadata"].get("labels", {}))]
        assert services, f"ServiceMonitor {sm['metadata']['name']} selects no Service"
        for ep in sm["spec"]["endpoints"]:
            assert all(ep["port"] in {p["name"] for p in s["spec"]["ports"]} for s in services)
            assert ep["path"] == "/metrics"
    for np in _kinds(docs, "NetworkPolicy"):
        protected = [
            p for p in pods if _matches(np["spec"]["podSelector"]["matchLabels"], p["metadata"]["labels"])
        ]
        assert protected, f"NetworkPolicy {np['metadata']['name']} selects no pod"
        ports = {n for p in protected for c in p["spec"]["containers"] for n in _named_ports(c)}
        for rule in np["spec"]["ingress"]:
            assert all(p["port"] in ports for p in rule["ports"])
            for peer in rule.get("from", []):
                assert any(
                    _matches(peer["podSelector"]["matchLabels"], p["metadata"]["labels"]) for p in pods
                )


def test_k8s_vllm_event_ports_only_for_kvrouter(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    pol = _one(docs, "NetworkPolicy", "vllm-kv-events")
    router_labels = _one(docs, "Deployment", "kvrouter")["spec"]["template"]["metadata"]["labels"]
    event_rules = [
        r for r in pol["spec"]["ingress"] if {p["port"] for p in r["ports"]} & {"kv-events", "kv-replay"}
    ]
    assert event_rules, "no ingress rule names the event ports"
    for rule in event_rules:
        assert rule.get("from"), "the event ports are not open to every pod"
        assert any(_matches(p["podSelector"]["matchLabels"], router_labels) for p in rule["from"])


def test_k8s_optional_components(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = rendered
    router = _container(_one(docs, "Deployment", "kvrouter")["spec"]["template"]["spec"], "kvrouter")
    env = {e["name"]: e.get("value") for e in router.get("env", [])}
    if "KVROUTER_REDIS_URL" in env:
        url = urlsplit(env["KVROUTER_REDIS_URL"] or "")
        assert url.scheme == "redis"
        redis = _one(docs, "Service", url.hostname or "")
        assert url.port in {p["port"] for p in redis["spec"]["ports"]}
    indexers = [d for d in _kinds(docs, "Deployment") if d["metadata"]["name"] == "kvrouter-indexer"]
    for dep in indexers:
        c = dep["spec"]["template"]["spec"]["containers"][0]
        ns = _parse_kvrouter(c["args"])
        assert ns.host == "0.0.0.0" and _named_ports(c) == {"http": ns.port}
    if name == "prod":
        assert "KVROUTER_REDIS_URL" in env and indexers, "prod runs Redis and a standalone indexer"
        assert _kinds(docs, "ServiceMonitor")
        assert _one(docs, "Deployment", "kvrouter")["spec"]["replicas"] >= 2


# ------------------------------------------------------------------------------------------------ Grafana
@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    doc = json.loads(DASHBOARD.read_text())
    assert isinstance(doc, dict)
    return doc


def _exprs(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_dashboard_layout(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] == "kvrouter" and dashboard["title"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    var = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert var["datasource"]["type"] == "datasource" and var["datasource"]["query"] == "prometheus"
    for p in dashboard["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        for t in p.get("targets", []):
            # Every query goes to the chosen data source, so one file serves Compose and Kubernetes.
            assert t["datasource"]["uid"] == "${datasource}", p["title"]
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
    assert len(_exprs(dashboard)) >= 20


def test_dashboard_metrics_exist(dashboard: dict[str, Any]) -> None:
    exported = _exported_metrics()
    samples = {s for names in exported.values() for s in names}
    used: set[str] = set()
    for expr in _exprs(dashboard):
        for name in re.findall(r"\b(?:kvrouter_\w+|vllm:[\w:]+)", expr):
            assert name in samples | VLLM_METRICS, f"{name!r} is not exported (query: {expr})"
            used.add(name)
            if name.endswith("_bucket"):
                assert "histogram_quantile(" in expr, f"{name} outside histogram_quantile: {expr}"
            if name.endswith("_total"):
                assert re.search(rf"(rate|increase)\({re.escape(name)}\[", expr), f"rate() the counter {name}"
    shown = {family for family, names in exported.items() if names & used}
    assert shown >= REQUIRED_FAMILIES, f"families without a panel: {REQUIRED_FAMILIES - shown}"


def test_exported_metric_names_are_known() -> None:
    """The suffix rules the dashboard check relies on hold for the real exposition."""
    exported = _exported_metrics()
    assert exported["kvrouter_requests"] >= {"kvrouter_requests_total"}
    assert exported["kvrouter_routing_decision_seconds"] >= {"kvrouter_routing_decision_seconds_bucket"}
    assert exported["kvrouter_indexer_batches"] >= {"kvrouter_indexer_batches_total"}
    assert exported["kvrouter_queue_depth"] == {"kvrouter_queue_depth"}


# ------------------------------------------------------------------------------------------------- README
def test_readme_snippets() -> None:
    """The README's --kv-events-config examples parse, and the files it names exist."""
    text = (DEPLOY / "README.md").read_text()
    configs = re.findall(r"--kv-events-config\s+'(\{.*?\})'", text, re.S)
    assert configs
    for raw in configs:
        _kv_events(["--kv-events-config", raw])
    for rel in re.findall(r"`(deploy/[\w./-]+)`", text):
        assert (ROOT / rel).exists(), f"deploy/README.md names {rel}, which does not exist"
