"""Kubernetes discovery against the fake API server over HTTP on 127.0.0.1, through the Kubernetes client
(lightkube): initial list, adds, removes and readiness changes through the watch, bookmark resumption, 410
Gone (HTTP status and ERROR event) and relist, reconnect after a dropped watch, paging, auth, and the diffs
the reconciler receives."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import httpx2
import pytest

from indexer.config import InstanceConfig
from kvrouter.membership import (
    DiscoveryConfig,
    EndpointSliceDiscovery,
    KubeApi,
    KubeConnection,
    Reconciler,
    diff,
)
from kvrouter.membership.model import MembershipDiff, by_name
from tests.support.fake_apiserver import FakeApiServer, make_slice
from tests.support.membership import FakeMembership
from tests.support.net import free_port
from tests.support.wait import until

SVC = "vllm"


@dataclass
class Rig:
    api: FakeApiServer
    disc: EndpointSliceDiscovery
    seen: list[list[InstanceConfig]] = field(default_factory=list)

    def names(self) -> list[str]:
        return [i.name for i in self.seen[-1]] if self.seen else []

    def last_diff(self) -> MembershipDiff:
        return diff(by_name(self.seen[-2]), by_name(self.seen[-1]))

    def calls(self, kind: Literal["list", "watch"]) -> list[str | None]:
        return [r.resource_version for r in self.api.requests if r.kind == kind and r.status == 200]


def seed(api: FakeApiServer) -> None:
    api.put(make_slice("vllm-a", SVC, [("p0", "10.0.0.1", True), ("p1", "10.0.0.2", False)]))
    api.put(make_slice("vllm-b", SVC, [("p2", "10.0.0.3", True)], labels={"kvrouter.io/dp-size": "2"}))
    api.put(make_slice("other-a", "other", [("o0", "10.0.1.1", True)]))


@contextlib.asynccontextmanager
async def make_rig(
    tmp_path: Path,
    *,
    gone_as: Literal["status", "event"] = "event",
    token_file: str | None = None,
    **cfg: object,
) -> AsyncIterator[Rig]:
    api = FakeApiServer(token="s3cret", gone_as=gone_as)
    url = await api.start(free_port())
    seed(api)
    conn = KubeConnection(url, "default", token=None if token_file else "s3cret", token_file=token_file)
    dcfg = DiscoveryConfig(service=SVC, backoff_min_s=0.01, backoff_max_s=0.05, **cfg)  # type: ignore[arg-type]
    kube = KubeApi(conn)
    rig = Rig(api, EndpointSliceDiscovery(dcfg, kube, lambda s: None, rng=random.Random(1)))
    rig.disc.on_instances = rig.seen.append
    rig.disc.start()
    try:
        yield rig
    finally:
        await rig.disc.stop()
        await kube.close()
        await api.stop()


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    async with make_rig(tmp_path) as r:
        yield r


async def test_initial_list_gives_the_ready_pods(rig: Rig) -> None:
    await asyncio.wait_for(rig.disc.synced.wait(), 15.0)
    assert rig.seen == [
        [
            InstanceConfig("p0", "http://10.0.0.1:8000", "tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558"),
            InstanceConfig(
                "p2", "http://10.0.0.3:8000", "tcp://10.0.0.3:5557", "tcp://10.0.0.3:5558", dp_size=2
            ),
        ]
    ]
    assert rig.calls("list") == [str(rig.api.rv)]
    await until(lambda: rig.api.open_watches == 1)
    w = next(r for r in rig.api.requests if r.kind == "watch")
    assert w.params["resourceVersion"] == str(rig.api.rv) and w.params["allowWatchBookmarks"] == "true"
    assert w.params["labelSelector"] == "kubernetes.io/service-name=vllm"


async def test_watch_adds_removes_and_readiness(rig: Rig) -> None:
    await until(lambda: rig.api.open_watches == 1)
    rig.api.put(make_slice("vllm-a", SVC, [("p0", "10.0.0.1", True), ("p1", "10.0.0.2", True)]))
    await until(lambda: rig.names() == ["p0", "p1", "p2"])
    assert rig.last_diff().summary() == {"added": ["p1"], "removed": [], "changed": []}

    rig.api.put(make_slice("vllm-a", SVC, [("p0", "10.0.0.1", False), ("p1", "10.0.0.2", True)]))
    await until(lambda: rig.names() == ["p1", "p2"])
    assert rig.last_diff().summary() == {"added": [], "removed": ["p0"], "changed": []}

    rig.api.delete("vllm-b")
    await until(lambda: rig.names() == ["p1"])
    rig.api.put(make_slice("vllm-c", SVC, [("p2", "10.0.0.9", True)]))  # p2 back, elsewhere
    await until(lambda: rig.names() == ["p1", "p2"])
    assert rig.seen[-1][1].url == "http://10.0.0.9:8000" and rig.seen[-1][1].dp_size == 1

    updates = rig.disc.counters["updates"]
    rig.api.put(make_slice("other-a", "other", []))  # another Service: not even sent to us
    rig.api.put(
        make_slice(
            "vllm-c",
            SVC,
            [("p2", "10.0.0.9", True)],
            ports={"http": 8000, "kv-events": 5557, "kv-replay": 5558, "metrics": 9},
        )
    )
    await until(lambda: rig.disc.cache.resource_version == str(rig.api.rv))
    assert rig.disc.counters["updates"] == updates  # a change that changes no instance is not passed on
    assert rig.calls("list") == [rig.calls("list")[0]] and rig.disc.counters["events_MODIFIED"] >= 3


async def test_bookmark_lets_a_watch_resume_past_compaction(rig: Rig) -> None:
    await until(lambda: rig.api.open_watches == 1)
    listed_rv = rig.disc.cache.resource_version
    for k in range(5):  # the collection moves on, in changes our selector never shows us
        rig.api.put(make_slice("other-a", "other", [("o0", f"10.0.1.{k}", True)]))
    rig.api.bookmark()
    await until(lambda: rig.disc.cache.resource_version == str(rig.api.rv))
    assert rig.disc.counters["events_BOOKMARK"] == 1 and listed_rv != str(rig.api.rv)
    rig.api.compact()  # history before the bookmark is gone: only its RV can resume
    rig.api.drop_watches()
    await until(lambda: len(rig.calls("watch")) == 2)
    assert rig.calls("watch")[-1] == str(rig.api.rv)
    assert rig.disc.counters["gone"] == 0 and len(rig.calls("list")) == 1
    rig.api.put(make_slice("vllm-b", SVC, []))
    await until(lambda: rig.names() == ["p0"])


async def test_without_the_bookmark_the_same_resume_is_gone_and_relists(rig: Rig) -> None:
    await until(lambda: rig.api.open_watches == 1)
    for k in range(5):
        rig.api.put(make_slice("other-a", "other", [("o0", f"10.0.1.{k}", True)]))
    rig.api.compact()
    rig.api.drop_watches()
    await until(lambda: rig.disc.counters["relists"] == 1)  # applied, not only answered by the server
    assert rig.disc.counters["gone"] == 1 and len(rig.calls("list")) == 2
    assert len(rig.seen) == 1  # the relist found the same instances: nothing passed on


@pytest.mark.parametrize("gone_as", ["status", "event"])
async def test_410_relists_and_the_relist_catches_up(
    tmp_path: Path, gone_as: Literal["status", "event"]
) -> None:
    async with make_rig(tmp_path, gone_as=gone_as) as rig:
        await until(lambda: rig.api.open_watches == 1)
        rig.api.drop_watches()
        rig.api.delete("vllm-b")  # while the watch is down: p2 leaves, p3 joins
        rig.api.put(make_slice("vllm-d", SVC, [("p3", "10.0.0.4", True)]))
        rig.api.compact()
        await until(lambda: rig.names() == ["p0", "p3"])
        assert rig.disc.counters["gone"] >= 1 and len(rig.calls("list")) >= 2
        assert rig.last_diff().summary() == {"added": ["p3"], "removed": ["p2"], "changed": []}
        rejected = [r for r in rig.api.requests if r.kind == "watch" and r.status == 410]
        assert bool(rejected) == (gone_as == "status")


async def test_an_error_event_on_an_open_watch_relists(rig: Rig) -> None:
    await until(lambda: rig.api.open_watches == 1)
    rig.api.expire_watches()
    await until(lambda: len(rig.calls("list")) == 2)
    assert rig.disc.counters["events_ERROR"] == 1 and rig.disc.counters["gone"] == 1


async def test_a_dropped_watch_resumes_from_the_last_version(rig: Rig) -> None:
    await until(lambda: rig.api.open_watches == 1)
    rig.api.put(make_slice("vllm-a", SVC, [("p0", "10.0.0.1", True)]))
    await until(lambda: rig.disc.cache.resource_version == str(rig.api.rv))
    seen_rv = rig.disc.cache.resource_version
    rig.api.drop_watches()
    rig.api.delete("vllm-b")  # happens while we reconnect: delivered from history
    await until(lambda: rig.names() == ["p0"])
    assert rig.calls("watch")[-1] == seen_rv and len(rig.calls("list")) == 1
    assert rig.disc.counters["gone"] == 0


async def test_server_side_watch_timeout_rewatches_without_relist(tmp_path: Path) -> None:
    async with make_rig(tmp_path, watch_timeout_s=1) as rig:
        await until(lambda: len(rig.calls("watch")) >= 2)
        assert len(rig.calls("list")) == 1 and rig.calls("watch")[1] == rig.calls("watch")[0]


async def test_paged_list_and_an_expired_continue_token(tmp_path: Path) -> None:
    async with make_rig(tmp_path, page_size=1) as rig:
        await asyncio.wait_for(rig.disc.synced.wait(), 15.0)
        assert rig.names() == ["p0", "p2"]
        pages = [r for r in rig.api.requests if r.kind == "list"]
        assert len(pages) == 2 and "continue" in pages[1].params  # two slices of this Service, one a page
    async with make_rig(tmp_path, page_size=1) as rig:
        await rig.disc.stop()
        transport = rig.disc.api.transport
        real, calls = transport.inner, 0

        class CompactAfterFirstPage(httpx2.AsyncBaseTransport):
            async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
                nonlocal calls
                calls += 1
                resp = await real.handle_async_request(request)
                if calls == 1:
                    await resp.aread()
                    rig.api.put(make_slice("vllm-a", SVC, [("p9", "10.0.0.9", True)]))
                    rig.api.compact()  # the first page's snapshot is gone before the second is asked for
                return resp

        transport.inner = CompactAfterFirstPage()
        rig.disc.start()
        # synced may be set already (by the list before the stop): wait for the relisted fleet itself
        await until(lambda: rig.names() == ["p2", "p9"])
        assert rig.disc.counters["gone"] == 1


async def test_a_rejected_token_is_retried_and_the_file_reread(tmp_path: Path) -> None:
    tok = tmp_path / "token"
    tok.write_text("wrong\n")
    async with make_rig(tmp_path, token_file=str(tok)) as rig:
        await until(lambda: rig.disc.counters["errors_http_401"] >= 2)
        assert rig.seen == [] and not rig.disc.synced.is_set()
        tok.write_text("s3cret\n")  # kubelet rotated the projected token
        await asyncio.wait_for(rig.disc.synced.wait(), 15.0)
        assert rig.names() == ["p0", "p2"]


async def test_an_api_outage_keeps_the_last_fleet(tmp_path: Path) -> None:
    async with make_rig(tmp_path) as rig:
        await until(lambda: rig.api.open_watches == 1)
        port = int(rig.api.base_url.rsplit(":", 1)[1])
        await rig.api.stop()
        await until(lambda: sum(v for k, v in rig.disc.counters.items() if k.startswith("errors_")) >= 2)
        assert len(rig.seen) == 1  # nothing learned, nothing changed
        rig.api.put(make_slice("vllm-b", SVC, []))
        await rig.api.start(port)  # back, with history: the watch resumes and sees the change
        await until(lambda: rig.names() == ["p0"])
        assert len(rig.calls("list")) == 1


async def test_discovery_drives_the_reconciler(tmp_path: Path) -> None:
    async with make_rig(tmp_path) as rig:
        m = FakeMembership()
        r = Reconciler(m, initial=[InstanceConfig("static", "http://s:1")], poll_s=0.005)

        def apply(insts: list[InstanceConfig]) -> None:
            r.set_desired("k8s", insts)

        rig.disc.on_instances = apply
        rig.api.put(make_slice("vllm-b", SVC, []))  # an RV the watch delivers, so on_instances is the new one
        await until(lambda: sorted(r.applied) == ["p0", "static"] and not r.busy())
        rig.api.put(make_slice("vllm-a", SVC, [("p1", "10.0.0.2", True)]))
        await until(lambda: sorted(r.applied) == ["p1", "static"] and not r.busy())
        assert ("drain", "p0") in m.calls and ("remove", "p0") in m.calls and ("add", "p1") in m.calls
        await r.stop()
