"""InferencePool discovery against the fake API server over HTTP on 127.0.0.1, through the Kubernetes client:
a pool created after start, scaled up and down, pods going not-ready and back, a pod relabelled out of the
selector, the selector changed (a new pod watch, the fleet never emptied on the way), the target ports
changed, the pool refused and deleted, a pod watch expired (relist), and the requests the API server saw."""

from __future__ import annotations

import contextlib
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from indexer.config import InstanceConfig
from indexer.errors import ConfigError
from kvrouter.membership import (
    DiscoveryConfig,
    InferencePoolDiscovery,
    KubeApi,
    KubeConnection,
    kube_connection,
)
from tests.support.fake_apiserver import FakeApiServer, make_pod, make_pool
from tests.support.net import free_port
from tests.support.wait import until

SEL = {"app": "vllm"}


@dataclass
class Rig:
    api: FakeApiServer
    disc: InferencePoolDiscovery
    seen: list[list[InstanceConfig]] = field(default_factory=list)

    def urls(self) -> dict[str, str | None]:
        return {i.name: i.url for i in self.seen[-1]} if self.seen else {}

    def pod_selectors(self) -> list[str]:
        return [r.params.get("labelSelector", "") for r in self.api.requests if r.resource == "Pod"]


def put_pod(api: FakeApiServer, name: str, ip: str, **kw: Any) -> None:
    api.put(make_pod(name, ip, labels=kw.pop("labels", SEL), **kw))


@contextlib.asynccontextmanager
async def make_rig(*, with_pool: bool = True, **cfg: Any) -> AsyncIterator[Rig]:
    api = FakeApiServer(token="s3cret")
    url = await api.start(free_port())
    put_pod(api, "vllm-0", "10.0.0.1")
    put_pod(api, "vllm-1", "10.0.0.2")
    put_pod(api, "other-0", "10.0.9.1", labels={"app": "other"})
    if with_pool:
        api.put(make_pool("vllm", SEL, [8000]))
    api.put(make_pool("another", {"app": "other"}, [9000]))  # a pool of someone else: never read
    kube = KubeApi(KubeConnection(url, "default", token="s3cret"))
    dcfg = DiscoveryConfig(pool="vllm", backoff_min_s=0.01, backoff_max_s=0.05, **cfg)
    rig = Rig(api, InferencePoolDiscovery(dcfg, kube, lambda s: None, rng=random.Random(1)))
    rig.disc.on_instances = rig.seen.append
    rig.disc.start()
    try:
        yield rig
    finally:
        await rig.disc.stop()
        await kube.close()
        await api.stop()


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    async with make_rig() as r:
        yield r


async def test_the_pools_ready_pods_on_its_target_port(rig: Rig) -> None:
    await until(lambda: rig.disc.synced.is_set())
    assert rig.seen == [
        [
            InstanceConfig("vllm-0", "http://10.0.0.1:8000", "tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558"),
            InstanceConfig("vllm-1", "http://10.0.0.2:8000", "tcp://10.0.0.2:5557", "tcp://10.0.0.2:5558"),
        ]
    ]
    await until(lambda: rig.api.watching("Pod") == 1 and rig.api.watching("InferencePool") == 1)
    pools = [r for r in rig.api.requests if r.resource == "InferencePool"]
    assert all(r.params["fieldSelector"] == "metadata.name=vllm" for r in pools)
    assert set(rig.pod_selectors()) == {"app=vllm"}  # the API server filters the pods
    watch = next(r for r in rig.api.requests if r.resource == "Pod" and r.kind == "watch")
    assert watch.params["allowWatchBookmarks"] == "true"
    assert (
        rig.disc.state()["target_ports"] == [8000] and rig.disc.state()["endpoint_picker"] == "kvrouter-epp"
    )


async def test_scaled_up_and_down_and_readiness(rig: Rig) -> None:
    await until(lambda: rig.api.watching("Pod") == 1)
    put_pod(rig.api, "vllm-2", "10.0.0.3", ready=False)  # scheduled, not ready yet: not routed
    put_pod(rig.api, "vllm-2", "10.0.0.3")
    await until(lambda: list(rig.urls()) == ["vllm-0", "vllm-1", "vllm-2"])
    assert len(rig.seen) == 2  # the not-ready step passed nothing on
    put_pod(rig.api, "vllm-0", "10.0.0.1", ready=False)  # probe failing
    await until(lambda: list(rig.urls()) == ["vllm-1", "vllm-2"])
    put_pod(rig.api, "vllm-0", "10.0.0.1")
    await until(lambda: list(rig.urls()) == ["vllm-0", "vllm-1", "vllm-2"])
    put_pod(rig.api, "vllm-2", "10.0.0.3", deleting=True)  # scaled down: terminating first ...
    await until(lambda: list(rig.urls()) == ["vllm-0", "vllm-1"])
    rig.api.delete("vllm-2", kind="Pod")  # ... then gone
    put_pod(rig.api, "vllm-1", "10.0.0.2", labels={"app": "debug"})  # relabelled out of the selector
    await until(lambda: list(rig.urls()) == ["vllm-0"])
    assert rig.disc.counters["events_DELETED"] >= 2 and rig.disc.counters["lists"] == 2  # pool + pods


async def test_a_changed_selector_reads_the_new_pods_without_emptying_the_fleet(rig: Rig) -> None:
    await until(lambda: rig.api.watching("Pod") == 1)
    put_pod(rig.api, "green-0", "10.0.1.1", labels={"app": "vllm-green"})
    put_pod(rig.api, "green-1", "10.0.1.2", labels={"app": "vllm-green"})
    rig.api.put(make_pool("vllm", {"app": "vllm-green"}, [8000]))
    await until(lambda: list(rig.urls()) == ["green-0", "green-1"])
    assert [list(map(lambda i: i.name, s)) for s in rig.seen] == [
        ["vllm-0", "vllm-1"],
        ["green-0", "green-1"],
    ]
    await until(lambda: rig.api.watching("Pod") == 1)  # the old selector's watch is closed
    assert rig.pod_selectors()[-1] == "app=vllm-green" and rig.disc.counters["selector_changes"] == 1
    put_pod(rig.api, "vllm-0", "10.0.0.7")  # the old selector's pods no longer count
    put_pod(rig.api, "green-2", "10.0.1.3", labels={"app": "vllm-green"})
    await until(lambda: list(rig.urls()) == ["green-0", "green-1", "green-2"])


async def test_changed_target_ports_move_every_endpoint(rig: Rig) -> None:
    await until(lambda: rig.api.watching("Pod") == 1)
    lists = rig.disc.counters["lists"]
    rig.api.put(make_pool("vllm", SEL, [8100]))
    await until(lambda: rig.urls() == {"vllm-0": "http://10.0.0.1:8100", "vllm-1": "http://10.0.0.2:8100"})
    assert rig.disc.counters["lists"] == lists  # the same pods: no new list, no new watch
    rig.api.put(make_pool("vllm", SEL, [8100, 8101]))  # two endpoints a pod
    await until(lambda: len(rig.urls()) == 4)
    assert rig.urls()["vllm-1-rank-1"] == "http://10.0.0.2:8101"
    assert rig.seen[-1][1].events == "tcp://10.0.0.1:5558"  # vllm-0-rank-1: vLLM's rank offset


async def test_a_refused_or_deleted_pool_selects_nothing_and_comes_back() -> None:
    async with make_rig(with_pool=False) as rig:
        await until(lambda: rig.disc.synced.is_set())
        assert rig.seen == [[]] and rig.disc.state()["pool"] is None  # an empty fleet, said once
        assert rig.api.watching("Pod") == 0
        rig.api.put(make_pool("vllm", SEL, [8000]))  # created after the router started
        await until(lambda: list(rig.urls()) == ["vllm-0", "vllm-1"])
        bad = make_pool("vllm", SEL, [8000])
        bad["spec"]["selector"]["matchLabels"] = {}
        rig.api.put(bad)
        await until(lambda: rig.seen[-1] == [])
        assert rig.disc.state()["refused"] == "selector" and rig.disc.counters["refused_selector"] == 1
        rig.api.put(make_pool("vllm", SEL, [8000]))
        await until(lambda: list(rig.urls()) == ["vllm-0", "vllm-1"])
        rig.api.delete("vllm", kind="InferencePool")
        await until(lambda: rig.seen[-1] == [])
        assert rig.disc.pods is None  # the pod watch is closed with its pool


async def test_an_expired_pod_watch_relists_and_catches_up(rig: Rig) -> None:
    await until(lambda: rig.api.watching("Pod") == 1)
    rig.api.drop_watches()
    rig.api.delete("vllm-1", kind="Pod")  # while the watches are down
    put_pod(rig.api, "vllm-3", "10.0.0.4")
    rig.api.compact()
    await until(lambda: list(rig.urls()) == ["vllm-0", "vllm-3"])
    assert rig.disc.counters["gone"] >= 1 and rig.disc.counters["relists"] >= 1


async def test_a_kubeconfig_context_reaches_the_api_server(tmp_path: Path) -> None:
    """Outside a cluster: the kubeconfig's named context gives the server, the token and the namespace."""
    api = FakeApiServer(token="ctx-token")
    url = await api.start(free_port())
    try:
        api.put(make_pod("vllm-0", "10.0.0.1", labels=SEL, namespace="inference"))
        api.put(make_pool("vllm", SEL, [8000], namespace="inference"))
        kc = tmp_path / "config"
        kc.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "elsewhere",
            "clusters": [{"name": "fake", "cluster": {"server": url}},
                         {"name": "nowhere", "cluster": {"server": "http://127.0.0.1:9"}}],
            "users": [{"name": "me", "user": {"token": "ctx-token"}}],
            "contexts": [{"name": "fake",
                          "context": {"cluster": "fake", "user": "me", "namespace": "inference"}},
                         {"name": "elsewhere", "context": {"cluster": "nowhere", "user": "me"}}],
        }))  # fmt: skip
        cfg = DiscoveryConfig(pool="vllm", context="fake", kubeconfig=str(kc))
        conn = kube_connection(cfg, {}, tmp_path / "no-service-account")
        assert (conn.kubeconfig, conn.context, conn.base_url) == (str(kc), "fake", "")
        kube = KubeApi(conn)
        seen: list[list[InstanceConfig]] = []
        disc = InferencePoolDiscovery(cfg, kube, seen.append)
        disc.start()
        try:
            await until(lambda: bool(seen) and [i.name for i in seen[-1]] == ["vllm-0"])
            assert kube.namespace == "inference" and kube.server == url
        finally:
            await disc.stop()
            await kube.close()
        env = {"KUBECONFIG": str(kc), "HOME": str(tmp_path)}
        assert kube_connection(DiscoveryConfig(pool="vllm"), env, tmp_path / "none").kubeconfig == str(kc)
        with pytest.raises(ConfigError):
            KubeApi(kube_connection(DiscoveryConfig(pool="vllm", context="nope", kubeconfig=str(kc)), {}))
    finally:
        await api.stop()
