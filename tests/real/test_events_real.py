"""KV events from real vLLM servers into ``kvrouter serve``: both of vLLM's publisher modes, live and by
replay, across a late start, a gateway restart and an engine killed mid-stream; and ``kvrouter check``."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp

from tests.real.conftest import FIGURES, RealFleet
from tests.support.real_gateway import Served, check, fleet_file, metric, reset_caches, run_calls, send
from tests.support.real_vllm import MODEL
from tests.support.real_workload import AgentWorkload


async def _all_heard(gw: Served, names: list[str], timeout: float = 60.0) -> None:
    """Until every source is connected and trusted (the replay of each engine's buffer done)."""

    async def ok() -> bool:
        h = await gw.health()
        src = {s["instance"]: s for s in h["index"]}
        return all(n in src and src[n]["connected"] and src[n]["trust"] == "exact" for n in names)

    deadline = asyncio.get_running_loop().time() + timeout
    while not await ok():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"sources not all heard: {(await gw.health())['index']}\n{gw.log_tail()}")
        await asyncio.sleep(0.2)


async def test_check_tells_a_stream_it_cannot_receive(fleet: RealFleet, tmp_path: Path) -> None:
    """URLs only: every instance passes, vllm-2 with the router binding where vLLM connects.  The same
    vllm-2 given as ``events: tcp://127.0.0.1:P`` to connect to (as a user would write it) fails, with
    the fix."""
    async with aiohttp.ClientSession() as s:  # a batch in each engine's buffer for check to read
        for srv in fleet.servers:
            body = {"model": MODEL, "prompt": "check " * 80, "max_tokens": 1}
            async with s.post(srv.spec.url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
    rc, report = check(fleet_file(tmp_path / "urls.yaml", fleet.servers))
    bad = {n: [c for c in cs if c["verdict"] != "ok"] for n, cs in report["instances"].items()}
    assert rc == 0, bad
    for s in fleet.servers:
        checks = {c["name"]: c for c in report["instances"][s.spec.name]}
        assert checks["events"]["verdict"] == "ok", checks
        assert checks["parity"]["verdict"] == "ok", checks
    assert (
        "router binds, vLLM connects"
        in {c["name"]: c for c in report["instances"]["vllm-2"]}["events"]["detail"]
    )
    assert "router connects" in {c["name"]: c for c in report["instances"]["vllm-0"]}["events"]["detail"]

    vllm2 = fleet.by_name("vllm-2")
    rc, report = check(fleet_file(tmp_path / "given.yaml", [vllm2], urls_only=False))
    assert rc == 1, report
    (ev,) = [c for c in report["instances"]["vllm-2"] if c["name"] == "events"]
    assert (
        ev["verdict"] == "fail" and "connects its PUB out" in ev["detail"] and "tcp://*:" in ev["detail"]
    ), ev


async def test_predicted_equals_reported_on_an_agent_workload(fleet: RealFleet, tmp_path: Path) -> None:
    """120 sequential agent-like requests, caches of 80 blocks (vLLM evicts): the router's predicted cached
    tokens equal vLLM's reported ones request by request, the connect-mode instance included."""
    async with aiohttp.ClientSession() as s:
        await reset_caches(s, fleet.servers)
    gw = await Served(fleet_file(tmp_path / "f.yaml", fleet.servers), fleet.log_dir).start()
    try:
        await _all_heard(gw, ["vllm-0", "vllm-1", "vllm-2"])
        tally = await run_calls(gw.url, AgentWorkload(seed=1).calls(120), health=gw.url + "/health")
        FIGURES["agent workload, kv-aware"] = tally.summary()
        text = await gw.metrics()
        removed = metric(text, "kvrouter_indexer_blocks_removed_total") or 0
        FIGURES["agent workload, blocks removed (evictions)"] = removed
        health = await gw.health()
    finally:
        gw.stop()
    assert removed > 0, "the workload must make vLLM evict"
    assert health["status"] == "ok", health["events"]
    by = {s["instance"]: s for s in health["index"]}
    assert by["vllm-2"]["mode"] == "bind" and by["vllm-2"]["live_batches"] > 0, by["vllm-2"]
    assert all(by[n]["trust"] == "exact" for n in by), by
    assert tally.exact >= 0.99 * tally.requests, tally.summary()


async def test_late_start_and_gateway_restart(fleet: RealFleet, tmp_path: Path) -> None:
    """Traffic before the router exists (it learns it by replay), then the router SIGKILLed mid-workload and
    started again: predictions stay exact."""
    wl = AgentWorkload(seed=2)
    async with aiohttp.ClientSession() as s:
        await reset_caches(s, fleet.servers)
        for i, (route, body) in enumerate(wl.calls(12)):  # straight to the engines, round robin
            async with s.post(fleet.servers[i % 3].spec.url + route, json=body) as r:
                assert r.status == 200, await r.text()
    path = fleet_file(tmp_path / "f.yaml", fleet.servers)
    gw = await Served(path, fleet.log_dir).start()
    try:
        await _all_heard(gw, ["vllm-0", "vllm-1", "vllm-2"])
        first = await run_calls(gw.url, wl.calls(24), health=gw.url + "/health")
        gw.kill()
        async with aiohttp.ClientSession() as s:  # traffic the router never sees
            for i, (route, body) in enumerate(wl.calls(6)):
                async with s.post(fleet.servers[i % 3].spec.url + route, json=body) as r:
                    assert r.status == 200
        gw = await Served(path, fleet.log_dir, port=gw.port).start()
        await _all_heard(gw, ["vllm-0", "vllm-1", "vllm-2"])
        second = await run_calls(gw.url, wl.calls(24), health=gw.url + "/health")
    finally:
        gw.stop()
    FIGURES["late start"] = first.summary()
    FIGURES["after gateway restart"] = second.summary()
    assert first.exact >= first.requests - 1 and second.exact >= second.requests - 1, (
        first.summary(),
        second.summary(),
    )


async def test_engine_killed_mid_stream_and_restarted(fleet: RealFleet, tmp_path: Path) -> None:
    """vllm-1 SIGKILLed while it streams an answer, then started again on the same ports: its sequence
    numbers start over, the router drops what it knew of it, and predictions are exact again."""
    victim = fleet.by_name("vllm-1")
    async with aiohttp.ClientSession() as s:
        await reset_caches(s, fleet.servers)
    gw = await Served(fleet_file(tmp_path / "f.yaml", fleet.servers), fleet.log_dir).start()
    wl = AgentWorkload(seed=3)
    try:
        await _all_heard(gw, ["vllm-0", "vllm-1", "vllm-2"])
        await run_calls(gw.url, wl.calls(15), health=gw.url + "/health")
        async with aiohttp.ClientSession() as s:
            route, body = wl.calls(1)[0]
            body = {**body, "max_tokens": 400, "stream": True}
            async with s.post(victim.spec.url + route, json=body) as r:  # straight to the victim
                assert r.status == 200
                await r.content.readline()  # it is streaming
                victim.kill()
                try:
                    await r.read()
                except aiohttp.ClientError:
                    pass
        await until_unhealthy(gw, "vllm-1")
        victim.start()
        await victim.wait_ready()
        await until_restart_seen(gw, "vllm-1")
        after = await run_calls(gw.url, wl.calls(24), health=gw.url + "/health")
        by = {s["instance"]: s for s in (await gw.health())["index"]}
    finally:
        gw.stop()
    FIGURES["after engine SIGKILL + restart"] = after.summary()
    assert by["vllm-1"]["trust"] == "exact", by["vllm-1"]
    assert after.exact >= after.requests - 1, after.summary()


async def until_unhealthy(gw: Served, name: str) -> None:
    for _ in range(300):
        if not (await gw.health())["instances"][name]["healthy"]:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{name} never left rotation")


async def until_restart_seen(gw: Served, name: str) -> None:
    """The router saw the engine come back: healthy again and its source reconnected."""
    for _ in range(1200):
        h = await gw.health()
        src = [s for s in h["index"] if s["instance"] == name]
        if h["instances"][name]["healthy"] and src and src[0]["connected"]:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{name} not back: {h}")


async def test_a_deaf_source_is_loud(fleet: RealFleet, tmp_path: Path) -> None:
    """The defect this tier found: vllm-2 connects its PUB out, the fleet file says to connect to it.  The
    gateway hears nothing while vllm-2 computes prompts, and says so: log, metric, /health."""
    vllm2 = fleet.by_name("vllm-2")
    async with aiohttp.ClientSession() as s:
        await reset_caches(s, [vllm2])
    gw = await Served(fleet_file(tmp_path / "f.yaml", [vllm2], urls_only=False), fleet.log_dir).start()
    try:
        async with aiohttp.ClientSession() as s:
            for i in range(4):
                prompt = f"request {i} " + " ".join(["deaf"] * 100)
                o = await send(
                    s, gw.url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2}
                )
                assert o.status == 200, o.body

        async def degraded() -> bool:
            return (await gw.health())["status"] == "events_degraded"

        await until_async(degraded, 30, "events_degraded in /health")
        health = await gw.health()
        text = await gw.metrics()
    finally:
        gw.stop()
    assert "vllm-2/0" in health["events"]["deaf"], health["events"]
    assert metric(text, "kvrouter_event_source_deaf", source="vllm-2/0") == 1.0
    assert "source deaf" in gw.log_path.read_text()


async def until_async(cond: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{what} not met in {timeout} s")
        await asyncio.sleep(0.2)
