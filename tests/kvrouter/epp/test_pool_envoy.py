"""An InferencePool followed by both front doors at once: the Endpoint Picker behind a real Envoy and
``kvrouter serve``, each discovering the pool's pods through the fake API server.

Three simulated vLLM pods listen on 127.0.0.2, .3 and .4, all on the same port (the pool's one target
port, as pods of one Deployment do); the pool selects by label.  As the cluster changes (a pod becomes
ready, one goes not-ready, the selector narrows to a canary) both routers follow without a restart, and
every request Envoy forwards lands on a pod the pool holds at that moment.  The picker finds each pod's KV
events from vLLM's ``/kv_event_sources`` (its fleet file gives no events port); serve from the pod's named
container port."""

from __future__ import annotations

import contextlib
import random
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvrouter.gateway import Gateway
from kvrouter.lab.sim.server.fleet import SimFleet, SimFleetConfig, port_range
from tests.support.envoy import envoy_binary, envoy_config, picker, running_envoy, served_counts
from tests.support.fake_apiserver import FakeApiServer, make_pod, make_pool
from tests.support.gateway import MODEL, gateway
from tests.support.net import free_port
from tests.support.wait import until

pytestmark = pytest.mark.skipif(envoy_binary() is None, reason="envoy not installed (make install)")

HOSTS = {"pod-a": "127.0.0.2", "pod-b": "127.0.0.3", "pod-c": "127.0.0.4"}
SEL = {"app": "vllm"}


def common_port(hosts: list[str], n: int = 3) -> int:
    """A base port p with p .. p+n-1 free on every host (a pool's target port is the same on every pod)."""
    rng = random.Random()
    for _ in range(200):
        lo, hi = port_range()
        base = rng.randrange(lo, hi - n)
        socks: list[socket.socket] = []
        try:
            for h in hosts:
                for p in range(base, base + n):
                    s = socket.socket()
                    socks.append(s)
                    s.bind((h, p))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        return base
    raise RuntimeError("no common free port")


@contextlib.asynccontextmanager
async def pods() -> AsyncIterator[tuple[dict[str, SimFleet], int]]:
    port = common_port(list(HOSTS.values()))
    fleets: dict[str, SimFleet] = {}
    try:
        for name, host in HOSTS.items():
            first = next(iter(fleets.values()), None)
            cfg = SimFleetConfig(instances=1, name_prefix=name, host=host, base_port=port, profile="test",
                                 capacity_blocks=2048)  # fmt: skip
            f = SimFleet(cfg) if first is None else SimFleet(cfg, tokenizer=first.tokenizer,
                                                             chat_template=first.chat_template)  # fmt: skip
            await f.start()
            fleets[name] = f
        yield fleets, port
    finally:
        for f in reversed(fleets.values()):
            await f.stop()


def pod(name: str, port: int, *, ready: bool = True, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return make_pod(name, HOSTS[name], ready=ready, labels=labels or SEL,
                    ports={"http": port, "kv-events": port + 1, "kv-replay": port + 2})  # fmt: skip


def discovery(api: FakeApiServer, **over: Any) -> dict[str, Any]:
    d = {"pool": "vllm", "api_url": api.base_url, "namespace": "default", "backoff_min_s": 0.05,
         "backoff_max_s": 0.2, "models": [MODEL]}  # fmt: skip
    return {"instances": [], "discovery": {**d, **over}}


def members(gw: Gateway) -> list[str]:
    """The pool's members, once each is in rotation (a new member takes traffic only after its first
    health check passes: before that, a request finding no other member is answered 503)."""
    ups = gw.pool.upstreams
    return sorted(ups) if all(u.healthy for u in ups.values()) else []


async def test_the_picker_and_serve_follow_the_pool(tmp_path: Path) -> None:
    async with pods() as (fleets, port), contextlib.AsyncExitStack() as stack:
        api = FakeApiServer()
        await api.start(free_port())
        stack.push_async_callback(api.stop)
        api.put(pod("pod-a", port))
        api.put(pod("pod-b", port))
        api.put(pod("pod-c", port, ready=False))  # starting
        api.put(make_pool("vllm", SEL, [port]))
        any_fleet = fleets["pod-a"]
        pk, server = await stack.enter_async_context(
            picker(any_fleet, **discovery(api, events_port=None, replay_port=None))
        )
        serve, _ = await stack.enter_async_context(gateway(any_fleet, **discovery(api)))
        base = await stack.enter_async_context(
            running_envoy(envoy_config(free_port(), free_port(), server.port), tmp_path)
        )
        s = await stack.enter_async_context(aiohttp.ClientSession())

        async def send(n: int) -> dict[str, int]:
            """``n`` requests through Envoy; how many each pod served."""
            before = {k: served_counts(f)[f.servers[0].name] for k, f in fleets.items()}
            for i in range(n):
                body = {"model": MODEL, "max_tokens": 2, "prompt": f"request {i} " + "word " * (50 + 7 * i)}
                async with s.post(base + "/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
            return {k: served_counts(f)[f.servers[0].name] - before[k] for k, f in fleets.items()}

        both = (pk.gw, serve)
        await until(lambda: all(members(g) == ["pod-a", "pod-b"] for g in both), what="pool listed")
        got = await send(8)
        assert got["pod-c"] == 0 and got["pod-a"] + got["pod-b"] == 8
        # events: serve from the pod's named port, the picker from each pod's /kv_event_sources
        assert serve.pool.upstreams["pod-a"].cfg.events == f"tcp://127.0.0.2:{port + 1}"
        await until(lambda: pk.gw.pool.upstreams["pod-b"].cfg.events == f"tcp://127.0.0.3:{port + 1}",
                    what="picker found pod-b's publisher")  # fmt: skip
        await until(lambda: {src.instance for src in pk.gw.indexer.sources()} >= {"pod-a", "pod-b"},
                    what="picker indexed both pods' events")  # fmt: skip

        api.put(pod("pod-c", port))  # ready: scaled up
        await until(lambda: all(members(g) == ["pod-a", "pod-b", "pod-c"] for g in both), what="pod-c added")
        api.put(pod("pod-a", port, ready=False))  # its readiness probe fails
        await until(lambda: all(members(g) == ["pod-b", "pod-c"] for g in both), what="pod-a removed")
        got = await send(8)
        assert got["pod-a"] == 0 and got["pod-b"] + got["pod-c"] == 8

        api.put(pod("pod-c", port, labels={**SEL, "track": "canary"}))
        api.put(make_pool("vllm", {**SEL, "track": "canary"}, [port]))  # the pool narrows to the canary
        await until(lambda: all(members(g) == ["pod-c"] for g in both), what="selector followed")
        got = await send(4)
        assert got == {"pod-a": 0, "pod-b": 0, "pod-c": 4}
        for g in both:
            d = g.membership.state()["discovery"]
            assert d["selector"] == "app=vllm,track=canary" and d["counters"]["selector_changes"] == 1
