"""Membership inside a real ``Gateway`` (HTTP on 127.0.0.1), wired as the lead's wiring does it: an instance
added through the fleet file takes traffic; removed while a request is in flight, it takes no new request
(503) and that request still completes before it leaves; Kubernetes discovery through the same runtime."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import yaml
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

from indexer.config import InstanceConfig
from kvrouter.config import load_router_fleet
from kvrouter.gateway import Gateway, build_gateway
from kvrouter.gateway.membership_metrics import MembershipCollector
from kvrouter.gateway.membership_runtime import MembershipRuntime
from kvrouter.membership import DiscoveryConfig, KubeConnection, MembershipConfig
from tests.support.fake_apiserver import FakeApiServer, make_slice
from tests.support.net import free_port


async def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


class Upstream:
    """A stand-in vLLM server whose completions wait until released."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.received = 0
        self.port = free_port()

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


def write(path: Path, instances: list[dict[str, object]]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump({"block_size": 16, "instances": instances}))
    tmp.replace(path)


@contextlib.asynccontextmanager
async def gateway(
    path: Path, discovery: DiscoveryConfig | None = None, conn: KubeConnection | None = None
) -> AsyncIterator[tuple[str, Gateway, MembershipRuntime]]:
    cfg = load_router_fleet(path)
    gw = Gateway(cfg)

    # The wiring proposed for Gateway (__init__ / start / stop), done from outside here.
    def added(inst: InstanceConfig) -> None:
        u = gw.pool.upstreams.get(inst.name)
        if u is not None:
            gw._health_changed(inst.name, u.healthy)

    def removed(inst: InstanceConfig) -> None:
        keys = [inst.name] if inst.dp_size == 1 else [f"{inst.name}/{r}" for r in range(inst.dp_size)]
        for key in keys:
            for gauge in (gw.metrics.healthy, gw.metrics.in_flight):
                with contextlib.suppress(KeyError):
                    gauge.remove(key)

    rt = MembershipRuntime(
        gw.pool,
        gw.indexer,
        gw.subscriber,
        cfg,
        fleet_path=path,
        options=MembershipConfig(reload_interval_s=0.02, drain_timeout_s=10.0),
        discovery=discovery,
        conn=conn,
        on_added=added,
        on_removed=removed,
    )
    rt.reconciler.poll_s = 0.01
    app = build_gateway(gw)

    async def membership_ctx(app: web.Application) -> AsyncIterator[None]:
        assert gw.session is not None
        await rt.start(gw.session)
        yield
        await rt.stop()

    app.cleanup_ctx.append(membership_ctx)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}", gw, rt
    finally:
        await runner.cleanup()


async def test_fleet_file_membership_through_the_gateway(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    write(path, [])
    up = Upstream()
    async with up.serve() as url, gateway(path) as (gw_url, gw, rt), aiohttp.ClientSession() as client:
        body = {"model": "m", "prompt": "hello"}
        async with client.post(f"{gw_url}/v1/completions", json=body) as r:
            assert r.status == 404  # no instance serves anything yet

        write(path, [{"name": "u0", "url": url}])
        await until(lambda: "u0" in rt.reconciler.applied and not rt.reconciler.busy())
        assert gw.pool.upstreams["u0"].healthy
        first = asyncio.create_task(client.post(f"{gw_url}/v1/completions", json=body))
        await until(lambda: up.received == 1)

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


async def test_kubernetes_discovery_through_the_gateway(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    write(path, [])
    up = Upstream()
    up.release.set()
    api = FakeApiServer()
    api_url = await api.start(free_port())
    ports = {"http": up.port}  # no event ports: routed by load only
    api.put(make_slice("vllm-1", "vllm", [("pod-a", "127.0.0.1", True)], ports=ports))
    disc = DiscoveryConfig(service="vllm", events_port=None, replay_port=None, backoff_min_s=0.01)
    try:
        async with up.serve(), gateway(path, disc, KubeConnection(api_url, "default")) as (gw_url, gw, rt):
            await until(lambda: "pod-a" in gw.pool.upstreams and gw.pool.upstreams["pod-a"].healthy)
            body = {"model": "m", "prompt": "x"}
            async with (
                aiohttp.ClientSession() as client,
                client.post(f"{gw_url}/v1/completions", json=body) as r,
            ):
                assert r.status == 200 and r.headers["x-kvrouter-instance"] == "pod-a"
            gauge = b'kvrouter_instance_healthy{target="pod-a"} 1.0'
            assert gauge in generate_latest(gw.metrics.registry)
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
                "kvrouter_membership_fleet_file_reloads_total 1.0",
            ):
                assert line in text, line
            assert gw.subscriber.fleet.instances == []
            assert b'kvrouter_instance_healthy{target="pod-a"' not in generate_latest(gw.metrics.registry)
    finally:
        await api.stop()
