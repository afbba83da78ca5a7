"""EndpointSlice → instances (pure), the list-watch cache, the discovery config and in-cluster resolution."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from indexer.errors import ConfigError
from kvrouter.membership import DiscoveryConfig, kube_connection
from kvrouter.membership.endpointslices import EndpointSlice, SliceCache, instances_of
from tests.support.fake_apiserver import make_slice

CFG = DiscoveryConfig(service="vllm")


def sl(*args: object, **kw: object) -> EndpointSlice:
    obj = make_slice(*args, **kw)  # type: ignore[arg-type]
    obj["metadata"]["resourceVersion"] = "7"
    return msgspec.json.decode(msgspec.json.encode(obj), type=EndpointSlice)


def test_ready_endpoints_with_named_ports() -> None:
    got, skipped = instances_of([sl("a", "vllm", [("p0", "10.1.0.5", True), ("p1", "10.1.0.6", False)])], CFG)
    assert [(i.name, i.url, i.events, i.replay, i.dp_size) for i in got] == [
        ("p0", "http://10.1.0.5:8000", "tcp://10.1.0.5:5557", "tcp://10.1.0.5:5558", 1)
    ]
    assert not skipped


def test_numeric_ports_and_no_replay() -> None:
    cfg = DiscoveryConfig(
        service="vllm", http_port=9000, events_port=6000, replay_port=None, topic="kv", weight=2
    )
    got, _ = instances_of([sl("a", "vllm", [("p0", "10.1.0.5", True)], ports={})], cfg)
    assert (got[0].url, got[0].events, got[0].replay, got[0].topic, got[0].weight) == (
        "http://10.1.0.5:9000",
        "tcp://10.1.0.5:6000",
        None,
        "kv",
        2.0,
    )


def test_missing_ports_are_counted() -> None:
    got, skipped = instances_of([sl("a", "vllm", [("p0", "10.1.0.5", True)], ports={"http": 80})], CFG)
    assert got[0].events is None and got[0].replay is None and skipped == {"no_events_port": 1}
    got, skipped = instances_of([sl("a", "vllm", [("p0", "10.1.0.5", True)], ports={"web": 80})], CFG)
    assert got == [] and skipped["no_http_port"] == 1


def test_dp_size_from_the_service_label_or_config() -> None:
    s = sl("a", "vllm", [("p0", "10.1.0.5", True)], labels={"kvrouter.io/dp-size": "4"})
    assert instances_of([s], CFG)[0][0].dp_size == 4
    assert instances_of([s], DiscoveryConfig(service="vllm", dp_size=2))[0][0].dp_size == 2
    bad = sl("a", "vllm", [("p0", "10.1.0.5", True)], labels={"kvrouter.io/dp-size": "zero"})
    got, skipped = instances_of([bad], CFG)
    assert got[0].dp_size == 1 and skipped == {"bad_dp_size": 1}


def test_nil_ready_is_ready_and_duplicates_and_ipv6_and_no_target_ref() -> None:
    raw = make_slice("b", "vllm", [("p0", "10.1.0.5", True), ("p1", "10.1.0.6", True)])
    del raw["endpoints"][0]["conditions"]["ready"]
    del raw["endpoints"][1]["targetRef"]
    b = msgspec.convert(raw, EndpointSlice)
    a = sl("a", "vllm", [("p0", "10.9.9.9", True)])  # the same pod in an earlier slice (by name) wins
    v6 = sl("c", "vllm", [("p7", "fd00::7", True)], address_type="IPv6")
    got, skipped = instances_of([b, v6, a], CFG)
    assert [(i.name, i.url) for i in got] == [
        ("p0", "http://10.9.9.9:8000"),
        ("vllm-10.1.0.6", "http://10.1.0.6:8000"),
    ]
    assert skipped == {"duplicate": 1, "address_type": 1}


def test_empty_slice_has_null_endpoints() -> None:
    assert instances_of([sl("a", "vllm", [])], CFG) == ([], {})


def test_cache_follows_events_and_bookmarks_move_only_the_version() -> None:
    c = SliceCache()
    c.replace([sl("a", "vllm", [("p0", "10.1.0.5", True)])], "10")
    assert c.resource_version == "10" and [i.name for i in c.instances(CFG)[0]] == ["p0"]
    bm = msgspec.convert({"metadata": {"resourceVersion": "15"}}, EndpointSlice)
    assert not c.apply("BOOKMARK", bm) and c.resource_version == "15" and list(c.slices) == ["a"]
    assert c.apply("ADDED", sl("b", "vllm", [("p1", "10.1.0.6", True)]))
    assert c.resource_version == "7"  # whatever the server says: versions are opaque, never compared
    assert c.apply("DELETED", sl("a", "vllm", []))
    assert not c.apply("DELETED", sl("zzz", "vllm", []))
    assert [i.name for i in c.instances(CFG)[0]] == ["p1"]


def test_config_validation() -> None:
    for bad in (
        {"service": ""},
        {"service": "s", "http_port": 0},
        {"service": "s", "events_port": ""},
        {"service": "s", "dp_size": 0},
        {"service": "s", "backoff_min_s": 5, "backoff_max_s": 1},
    ):
        with pytest.raises(ConfigError):
            msgspec.convert(bad, DiscoveryConfig).validate()
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"service": "s", "surprise": 1}, DiscoveryConfig)
    DiscoveryConfig(service="s", http_port=8000, events_port="kv", replay_port=None).validate()


def test_in_cluster_resolution(tmp_path: Path) -> None:
    (tmp_path / "namespace").write_text("inference\n")
    (tmp_path / "token").write_text("tok\n")
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    c = kube_connection(CFG, env, tmp_path)
    assert (c.base_url, c.namespace, c.bearer()) == ("https://10.96.0.1:443", "inference", "tok")
    assert c.ca_file is None and c.ssl_context() is True
    c6 = kube_connection(
        CFG, {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"}, tmp_path
    )
    assert c6.base_url == "https://[fd00::1]:443"
    explicit = DiscoveryConfig(service="vllm", api_url="http://127.0.0.1:8001/", namespace="ns")
    c2 = kube_connection(explicit, {}, tmp_path / "none")
    assert (c2.base_url, c2.namespace, c2.token_file) == ("http://127.0.0.1:8001", "ns", None)
    with pytest.raises(ConfigError):
        kube_connection(CFG, {}, tmp_path)
    with pytest.raises(ConfigError):
        kube_connection(DiscoveryConfig(service="vllm", api_url="https://x"), {}, tmp_path / "none")
    insecure = DiscoveryConfig(
        service="vllm", api_url="https://x", namespace="n", insecure_skip_tls_verify=True
    )
    assert kube_connection(insecure, {}, tmp_path / "none").ssl_context() is False
