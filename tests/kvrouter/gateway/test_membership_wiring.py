"""Membership inside a real ``Gateway`` (HTTP on 127.0.0.1), through the gateway's own wiring
(``Gateway(cfg, fleet_path=...)``: its ``MembershipRuntime`` with ``_instance_added`` / ``_instance_removed``,
started and stopped by the app): an instance added through the fleet file takes traffic and gets its health
gauge; removed while a request is in flight, it takes no new request (503), that request still completes
before it leaves, and its gauges go; Kubernetes discovery, configured in the same fleet file, likewise."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

from kvrouter.config import load_router_fleet
from kvrouter.gateway import Gateway, build_gateway
from kvrouter.gateway.membership_metrics import MembershipCollector
from tests.support.fake_apiserver import FakeApiServer, make_slice
from tests.support.gateway import serving, with_front
from tests.support.net import free_port
from tests.support.wait import until


class Upstream:
    """A stand-in vLLM server whose completions wait until released."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.received = 0
        self.asked_sources = 0
        self.port = free_port()

    async def event_sources(self, request: web.Request) -> web.Response:
        self.asked_sources += 1
        return web.Response(status=404)  # as vLLM before 0.33: routed by load

    async def completions(self, request: web.Request) -> web.Response:
        self.received += 1
        await self.release.wait()
        return web.json_response({"choices": [{"text": "ok"}], "usage": {"prompt_tokens": 1}})

    @contextlib.asynccontextmanager
    async def serve(self) -> AsyncIterator[str]:
        app = web.Application()
        app.router.add_get("/health", _ok)
        app.router.add_get("/v1/models", _models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/kv_event_sources", self.event_sources)
        runner = web.AppRunner(app, handle_signals=False)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        try:
            yield f"http://127.0.0.1:{self.port}"
        finally:
            await runner.cleanup()


async def _ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"data": [{"id": "m"}]})


def write(path: Path, instances: list[dict[str, object]], **sections: Any) -> None:
    doc = {
        "block_size": 16,
        "instances": instances,
        "membership": {"reload_interval_s": 0.02, "drain_timeout_s": 30.0},
        "gateway": {"health_interval_s": 0.2},
        **sections,
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(with_front(doc)))
    tmp.replace(path)


@contextlib.asynccontextmanager
async def gateway(path: Path) -> AsyncIterator[tuple[str, Gateway]]:
    """The gateway exactly as ``kvrouter serve`` builds it from the fleet file at ``path``."""
    gw = Gateway(load_router_fleet(path), fleet_path=str(path))
    async with serving(gw, build_gateway(gw)) as base:
        yield base, gw


async def gauges(base: str) -> str:
    """What a scrape of the gateway's /metrics shows."""
    async with aiohttp.ClientSession() as s, s.get(f"{base}/metrics") as r:
        return await r.text()


async def test_fleet_file_membership_through_the_gateway(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    write(path, [])
    up = Upstream()
    async with up.serve() as url, gateway(path) as (gw_url, gw), aiohttp.ClientSession() as client:
        rt = gw.membership
        body = {"model": "m", "prompt": "hello"}
        async with client.post(f"{gw_url}/v1/completions", json=body) as r:
            assert r.status == 404  # no instance serves anything yet

        # u0 joins, and so does an instance that is down from the start (nothing listens on its port)
        down = {"name": "down", "url": f"http://127.0.0.1:{free_port()}"}
        write(path, [{"name": "u0", "url": url}, down])
        await until(lambda: {"u0", "down"} <= set(rt.reconciler.applied) and not rt.reconciler.busy())
        assert gw.pool.upstreams["u0"].healthy and not gw.pool.upstreams["down"].healthy
        text = await gauges(gw_url)
        assert 'kvrouter_instance_healthy{target="u0"} 1.0' in text
        assert 'kvrouter_instance_healthy{target="down"} 0.0' in text  # reported down, not absent
        await until(lambda: up.asked_sources >= 1, what="the gateway asking u0 for its event publishers")
        first = asyncio.create_task(client.post(f"{gw_url}/v1/completions", json=body))
        await until(lambda: up.received == 1)
        assert 'kvrouter_instance_in_flight{target="u0"} 1.0' in await gauges(gw_url)

        write(path, [])  # u0 leaves while a request is in flight on it
        await until(lambda: "u0" in rt.reconciler.draining)
        async with client.post(f"{gw_url}/v1/completions", json=body) as r:
            assert r.status == 503  # draining: no new request goes there
        assert up.received == 1 and "u0" in gw.pool.upstreams

        up.release.set()
        resp = await first
        assert resp.status == 200 and (await resp.json())["choices"][0]["text"] == "ok"
        resp.release()
        await until(lambda: "u0" not in gw.pool.upstreams and not rt.reconciler.busy())
        assert rt.reconciler.counters["drain_timeouts"] == 0
        state = rt.state()
        assert state["applied"] == [] and state["fleet_file"]["counters"]["reloads"] >= 2
        # _instance_removed: no gauge is left behind for an instance that is gone (counters stay)
        text = await gauges(gw_url)
        assert "kvrouter_instance_healthy{" not in text
        assert 'kvrouter_instance_in_flight{target="u0"}' not in text


async def test_kubernetes_discovery_through_the_gateway(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    up = Upstream()
    up.release.set()
    api = FakeApiServer()
    api_url = await api.start(free_port())
    ports = {"http": up.port}  # no event ports: routed by load only
    api.put(make_slice("vllm-1", "vllm", [("pod-a", "127.0.0.1", True)], ports=ports))
    discovery = {
        "service": "vllm",
        "namespace": "default",
        "api_url": api_url,
        "events_port": None,
        "replay_port": None,
        "backoff_min_s": 0.01,
    }
    write(path, [], discovery=discovery)
    try:
        async with up.serve(), gateway(path) as (gw_url, gw):
            rt = gw.membership
            await until(lambda: "pod-a" in gw.pool.upstreams and gw.pool.upstreams["pod-a"].healthy)
            body = {"model": "m", "prompt": "x"}
            async with (
                aiohttp.ClientSession() as client,
                client.post(f"{gw_url}/v1/completions", json=body) as r,
            ):
                assert r.status == 200 and r.headers["x-kvrouter-instance"] == "pod-a"
            assert 'kvrouter_instance_healthy{target="pod-a"} 1.0' in await gauges(gw_url)
            api.put(make_slice("vllm-1", "vllm", [("pod-a", "127.0.0.1", False)], ports=ports))
            await until(lambda: "pod-a" not in gw.pool.upstreams)
            assert rt.state()["discovery"]["synced"] and gw.subscriber is not None
            reg = CollectorRegistry()
            reg.register(MembershipCollector(rt))
            text = generate_latest(reg).decode()
            for line in (
                'kvrouter_membership_instances{state="applied"} 0.0',
                'kvrouter_membership_steps_total{op="added"} 1.0',
                'kvrouter_membership_steps_total{op="removed"} 1.0',
                "kvrouter_membership_discovery_synced 1.0",
                "kvrouter_membership_discovery_lists_total 1.0",
                'kvrouter_membership_discovery_events_total{type="MODIFIED"} 1.0',
            ):
                assert line in text, line
            assert gw.subscriber.fleet.instances == []
            text = await gauges(gw_url)
            assert "kvrouter_instance_healthy{" not in text and "kvrouter_instance_in_flight{" not in text
    finally:
        await api.stop()
