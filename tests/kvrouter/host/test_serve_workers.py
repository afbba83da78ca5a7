"""``kvrouter serve --workers 2`` as a real process tree in front of held upstreams: the workers agree on
load, health and the limits' queue as one process would, and a worker that dies is replaced.

Which worker answers a connection is the kernel's choice (SO_REUSEPORT): every check is made over many
fresh connections, so both workers answer some of them (the chance that 30 all reach one is 2^-29).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web

from tests.support.gateway import with_front
from tests.support.net import free_port
from tests.support.redis_server import RedisServer, redis_server
from tests.support.wait import until, until_async

__all__ = ["redis_server"]

MODEL = "held-model"


class HeldFleet:
    """Upstream instances whose completions wait until released (``fail``: answer 500 at once)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.ports = [free_port() for _ in range(n)]
        self.release = asyncio.Event()
        self.held = 0
        self.served: dict[int, int] = {p: 0 for p in self.ports}
        self.failing: set[int] = set()
        self.arrived: list[str] = []
        """Prompts in the order they reached any instance."""
        self._runners: list[web.AppRunner] = []

    def app(self, port: int) -> web.Application:
        async def completions(request: web.Request) -> web.StreamResponse:
            req = await request.json()
            self.arrived.append(req.get("prompt", ""))
            self.served[port] += 1
            if port in self.failing:
                return web.json_response({"error": "boom"}, status=500)
            self.held += 1
            try:
                await self.release.wait()
            finally:
                self.held -= 1
            if not req.get("stream"):
                return web.json_response({"choices": [{"text": "ok"}], "usage": {"prompt_tokens": 3}})
            sse = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await sse.prepare(request)
            await sse.write(b'data: {"choices": [{"text": "ok"}]}\n\ndata: [DONE]\n\n')
            await sse.write_eof()
            return sse

        async def ok(request: web.Request) -> web.Response:
            return web.Response(text="ok")

        async def metrics(request: web.Request) -> web.Response:
            return web.Response(text="# none\n")

        async def models(request: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        app.router.add_get("/health", ok)
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/v1/models", models)
        return app

    async def __aenter__(self) -> HeldFleet:
        for p in self.ports:
            r = web.AppRunner(self.app(p))
            await r.setup()
            await web.TCPSite(r, "127.0.0.1", p).start()
            self._runners.append(r)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release.set()
        for r in self._runners:
            await r.cleanup()

    def fleet(self, **over: Any) -> dict[str, Any]:
        return {
            "block_size": 16,
            "instances": [
                {"name": f"h{i}", "url": f"http://127.0.0.1:{p}"} for i, p in enumerate(self.ports)
            ],
            "gateway": {"health_interval_s": 0.2, "metrics_interval_s": 0.2},
            **over,
        }


@asynccontextmanager
async def serve(tmp: Path, fleet: dict[str, Any], workers: int = 2) -> AsyncIterator[tuple[str, int]]:
    path = tmp / "fleet.yaml"
    path.write_text(yaml.safe_dump(with_front(fleet)))
    port = free_port()
    cmd = [sys.executable, "-m", "kvrouter.cli", "--log-level", "WARNING", "serve", "--fleet", str(path)]
    cmd += ["--port", str(port), "--workers", str(workers), "--no-events"]
    log = open(tmp / "serve.log", "w")  # noqa: SIM115 - closed in the finally
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as s:

            async def up() -> bool:
                try:
                    async with s.get(base + "/livez") as r:
                        return r.status == 200
                except aiohttp.ClientError:
                    return False

            for _ in range(600):
                if await up() and len(children(proc.pid)) == (workers if workers > 1 else 0):
                    break
                assert proc.poll() is None, (tmp / "serve.log").read_text()[-2000:]
                await asyncio.sleep(0.1)
        yield base, proc.pid
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


async def fresh(
    method: str,
    url: str,
    body: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    *,
    text: bool = False,
) -> tuple[int, Any]:
    """One request on a connection of its own (so the kernel picks a worker for it); ``text``: the answer
    as text (a stream), not JSON."""
    conn = aiohttp.TCPConnector(force_close=True)
    # Bounded: a request the gateway wrongly forwards to a held upstream fails the test, not hangs it.
    timeout = aiohttp.ClientTimeout(total=90)
    async with (
        aiohttp.ClientSession(connector=conn, timeout=timeout) as s,
        s.request(method, url, json=body, headers=headers) as r,
    ):
        return r.status, (await r.text()) if text else (await r.json(content_type=None))


async def host_queue_waiting(base: str, n: int) -> bool:
    """The host's limits queue holds ``n`` waiters, as /health tells it (any worker: the rows are shared)."""
    st, got = await fresh("GET", base + "/health")
    assert st == 200, got
    return bool(got["worker"]["queue"]["waiting"] == n)


def body(i: int) -> dict[str, Any]:
    return {"model": MODEL, "prompt": f"prompt number {i}", "max_tokens": 4}


async def in_flight_seen(base: str, n: int = 30) -> list[int]:
    """What n fresh connections' explain answers say is in flight over every candidate."""
    out = []
    for i in range(n):
        st, got = await fresh("POST", base + "/v1/route/explain", body(1000 + i))
        assert st == 200, got
        out.append(sum(c["in_flight"] for c in got["candidates"]))
    return out


async def test_workers_agree_on_load_and_replace_a_dead_worker(tmp_path: Path) -> None:
    async with HeldFleet(3) as fleet, serve(tmp_path, fleet.fleet()) as (base, pid):
        tasks = [asyncio.create_task(fresh("POST", base + "/v1/completions", body(i))) for i in range(12)]
        await until(lambda: fleet.held == 12, what="12 requests held upstream")
        assert set(await in_flight_seen(base)) == {12}
        fleet.release.set()
        assert [st for st, _ in await asyncio.gather(*tasks)] == [200] * 12
        assert set(await in_flight_seen(base)) == {0}

        # A worker killed while it holds requests: replaced, and its requests no longer count.
        fleet.release.clear()
        held = [asyncio.create_task(fresh("POST", base + "/v1/completions", body(i))) for i in range(10)]
        await until(lambda: fleet.held == 10, what="10 requests held upstream")
        victim = children(pid)[1]
        os.kill(victim, signal.SIGKILL)
        await until(lambda: len(children(pid)) == 2 and victim not in children(pid), what="worker replaced")
        fleet.release.set()
        done = await asyncio.gather(*held, return_exceptions=True)
        survivors = sum(1 for d in done if isinstance(d, tuple) and d[0] == 200)
        assert survivors >= 1  # the other worker's requests complete (the victim's clients were cut off)
        for _ in range(100):
            async with aiohttp.ClientSession() as s, s.get(base + "/livez") as r:
                if r.status == 200:
                    break
            await asyncio.sleep(0.1)
        assert set(await in_flight_seen(base)) == {0}


async def test_workers_stop_when_their_supervisor_is_killed(tmp_path: Path) -> None:
    """The supervisor killed outright (SIGKILL, the OOM killer): its workers are told to stop (SIGTERM on
    their parent's death) and exit, rather than serve on as orphans nobody replaces or stops."""
    async with HeldFleet(2) as fleet, serve(tmp_path, fleet.fleet()) as (base, pid):
        fleet.release.set()
        assert (await fresh("POST", base + "/v1/completions", body(1)))[0] == 200
        workers = children(pid)
        assert len(workers) == 2
        os.kill(pid, signal.SIGKILL)

        def gone(w: int) -> bool:
            try:
                with open(f"/proc/{w}/stat") as f:
                    return f.read().split(") ")[1].startswith("Z")  # exited, not yet reaped
            except OSError:
                return True

        await until(lambda: all(gone(w) for w in workers), 30, "the orphaned workers exit")


async def test_failures_in_any_worker_eject_for_every_worker(tmp_path: Path) -> None:
    over = {"gateway": {"health_interval_s": 0.2, "failure_threshold": 4, "ejection_s": 60, "max_retries": 1}}
    async with HeldFleet(2) as fleet, serve(tmp_path, {**fleet.fleet(), **over}) as (base, _):
        fleet.release.set()
        bad = fleet.ports[0]
        fleet.failing.add(bad)
        for i in range(40):  # spread over both workers; each failure is retried on h1
            st, _ = await fresh("POST", base + "/v1/completions", body(i))
            assert st == 200
        # Four failures counted across the workers ejected h0 for every worker: no worker sends it more.
        assert fleet.served[bad] == 4
        for _ in range(30):
            st, got = await fresh("POST", base + "/v1/route/explain", body(7))
            assert [c["instance"] for c in got["candidates"]] == ["h1"]


async def test_the_limits_queue_is_the_hosts(tmp_path: Path) -> None:
    limits = {"limits": {"max_in_flight": 1, "queue_size": 3, "queue_timeout_s": 30}}
    async with HeldFleet(2) as fleet, serve(tmp_path, {**fleet.fleet(), **limits}) as (base, _):
        first = [asyncio.create_task(fresh("POST", base + "/v1/completions", body(i))) for i in range(2)]
        await until(lambda: fleet.held == 2, what="both instances at their cap")
        queued = []
        for i in range(3):
            queued.append(asyncio.create_task(fresh("POST", base + "/v1/completions", body(10 + i))))
            # In order: each waits in one worker or the other before the next is sent.
            await until_async(lambda n=i + 1: host_queue_waiting(base, n), what=f"{i + 1} waiting")
        refused = [await fresh("POST", base + "/v1/completions", body(20 + i)) for i in range(6)]
        assert [st for st, _ in refused] == [429] * 6  # the host's queue is full, whichever worker
        assert all(b["error"]["type"] for _, b in refused)
        assert fleet.held == 2
        fleet.release.set()
        assert [st for st, _ in await asyncio.gather(*first, *queued)] == [200] * 5


async def health_per_worker(base: str, workers: int = 2) -> dict[int, dict[str, Any]]:
    """/health as each worker answers it once both have seen an instance healthy (fresh connections until
    every worker answered 200)."""
    out: dict[int, dict[str, Any]] = {}
    for _ in range(600):
        st, got = await fresh("GET", base + "/health")
        if st == 200:
            out[got["worker"]["worker"]] = got
            if len(out) == workers:
                return out
        else:
            await asyncio.sleep(0.05)  # no health check has passed in that worker yet
    raise AssertionError(f"only workers {sorted(out)} answered 200")


async def test_every_worker_shares_with_the_other_replicas(tmp_path: Path, redis_server: RedisServer) -> None:
    """Replica a is ``serve --workers 2``, replica b one process (in this test), through a real Redis.  The
    leader makes the round trips for its host: what it publishes is the whole host's load as it is
    (requests held in either worker, and none once they are done), and what it reads reaches the other
    worker too (its /health says so: the metrics of one scrape are that one worker's)."""
    from indexer import Indexer
    from kvrouter.replicas import SharedState, SharedStateConfig
    from kvrouter.routing import RouteInput, Router, RouterConfig
    from kvrouter.routing.router import Target
    from kvrouter.types import InstanceId, RequestId

    rep = {"redis_url": redis_server.url, "namespace": "workers", "interval_s": 0.05}
    async with (
        HeldFleet(2) as fleet,
        serve(tmp_path, fleet.fleet(replicas={**rep, "replica_id": "a"})) as (
            base,
            _,
        ),
    ):
        rb = Router(Indexer(16), RouterConfig(shadow=False))
        b = SharedState(rb, SharedStateConfig(**rep, replica_id="b"))  # type: ignore[arg-type]
        await b.start()
        try:
            await health_per_worker(base)  # both workers route (each saw an instance healthy)
            held = [asyncio.create_task(fresh("POST", base + "/v1/completions", body(i))) for i in range(8)]
            await until(lambda: fleet.held == 8, 20, "8 requests held upstream")
            # b sees a's whole host: both workers' requests (each worker took some: 8 fresh connections)
            await until(
                lambda: sum(x.external_in_flight for x in rb.load.loads.values()) == 8, 10, "a's load"
            )
            # b's request in flight at h0: each of a's workers counts it
            inp = RouteInput(RequestId("b-1"), 400, None, b"x")
            rb.dispatched(inp, rb.route(inp, [Target(InstanceId("h0"))]).chosen, time.monotonic())  # type: ignore[arg-type]

            for _ in range(100):  # b's next round trip, then a's
                h = await health_per_worker(base)
                if h[1]["replicas"]["peers_in_flight"] == 1:
                    break
                await asyncio.sleep(0.1)
            assert (
                h[0]["replicas"]["round_trips"] and h[0]["replicas"]["up"] and h[0]["replicas"]["peers"] == 1
            )
            assert not h[1]["replicas"]["round_trips"] and h[1]["replicas"]["peers_in_flight"] == 1
            assert h[1]["replicas"]["peers_prefill_tokens"] == 400
            fleet.release.set()
            assert [st for st, _ in await asyncio.gather(*held)] == [200] * 8
            # and what a's workers finished leaves a's published load at once, whoever routes next (the
            # leader published the host's load as of its own last decision: the others' requests stayed)
            await until(lambda: sum(x.external_in_flight for x in rb.load.loads.values()) == 0, 10, "a idle")
        finally:
            await b.stop()


pytestmark = pytest.mark.skipif(os.cpu_count() is None, reason="needs /proc")


async def queue_depth(base: str) -> float:
    conn = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=conn) as s, s.get(base + "/metrics") as r:
        assert r.status == 200
        for line in (await r.text()).splitlines():
            if line.startswith("kvrouter_queue_depth "):
                return float(line.split()[1])
    return -1.0


async def test_priorities_and_rate_limits_are_the_hosts(tmp_path: Path) -> None:
    """Waiters in both workers are served as one queue: the high-priority tenant's request, queued last,
    is among the first dispatched; a tenant's rate limit counts its requests in every worker."""
    flows = {
        "limits": {"max_in_flight": 1, "queue_size": 16, "queue_timeout_s": 60},
        "flows": {
            "tenant_header": "x-tenant",
            "tenants": {"vip": {"priority": 1}, "capped": {"requests_per_minute": 3}},
        },
    }
    async with HeldFleet(2) as fleet, serve(tmp_path, {**fleet.fleet(), **flows}) as (base, _):
        first = [asyncio.create_task(fresh("POST", base + "/v1/completions", body(i))) for i in range(2)]
        await until(lambda: fleet.held == 2, what="both instances at their cap")
        low = {"x-tenant": "low"}
        queued = [
            asyncio.create_task(fresh("POST", base + "/v1/completions", body(10 + i), low)) for i in range(6)
        ]
        depth = 0.0

        async def waiting(n: int) -> bool:
            nonlocal depth
            depth = await queue_depth(base)
            return depth >= n

        for _ in range(600):
            if await waiting(6):
                break
            await asyncio.sleep(0.05)
        assert depth == 6
        vip = asyncio.create_task(fresh("POST", base + "/v1/completions", body(99), {"x-tenant": "vip"}))
        for _ in range(600):
            if await waiting(7):
                break
            await asyncio.sleep(0.05)
        assert depth == 7
        fleet.release.set()
        assert [st for st, _ in await asyncio.gather(*first, *queued, vip)] == [200] * 9
        after = fleet.arrived[2:]
        assert after.index("prompt number 99") <= 1, after  # two slots freed at once: vip is in the first two

        capped = [
            await fresh("POST", base + "/v1/completions", body(50 + i), {"x-tenant": "capped"})
            for i in range(8)
        ]
        assert sorted(st for st, _ in capped) == [200] * 3 + [429] * 5


async def test_a_burst_of_one_new_prompt_goes_to_one_instance(tmp_path: Path) -> None:
    """Without replicas the workers claim new prompts' targets among themselves: each burst of 6 requests
    of one new prompt, over fresh connections (both workers), goes to one instance, and the host's
    /metrics counts the claims (a worker whose choice agrees with the claim counts it won)."""
    async with HeldFleet(3) as fleet, serve(tmp_path, fleet.fleet()) as (base, _):
        for burst in range(4):
            prompt = list(range(burst * 1000, burst * 1000 + 200))
            before = dict(fleet.served)
            req = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
            tasks = [asyncio.create_task(fresh("POST", base + "/v1/completions", req)) for _ in range(6)]
            await until(lambda: fleet.held == 6, what="the burst held upstream")
            assert sorted(fleet.served[p] - before[p] for p in fleet.ports) == [0, 0, 6]
            fleet.release.set()
            assert [st for st, _ in await asyncio.gather(*tasks)] == [200] * 6
            fleet.release.clear()
        async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as r:
            text = await r.text()
        claims = {
            o: sum(
                float(ln.split()[-1])
                for ln in text.splitlines()
                if ln.startswith(f'kvrouter_host_prefix_claims_total{{outcome="{o}"}}')
            )
            for o in ("won", "followed", "full")
        }
        # every prompt claimed at least once, by whichever worker placed it first; none left unclaimed
        assert claims["won"] >= 4 and claims["full"] == 0, claims


async def test_workers_learn_one_set_of_latency_models(tmp_path: Path) -> None:
    """predicted-latency under ``--workers 2``: each worker trains the host's models with the requests it
    proxied, and every worker's /v1/fleet shows the same models, trained by every request."""
    over = {"routing": {"policy": "predicted-latency"}}
    async with HeldFleet(2) as fleet, serve(tmp_path, {**fleet.fleet(), **over}) as (base, _):
        fleet.release.set()  # answered at once: each stream's first chunk is a first token
        await health_per_worker(base)
        n = 24
        streams = [
            await fresh("POST", base + "/v1/completions", {**body(i), "stream": True}, text=True)
            for i in range(n)
        ]
        assert [st for st, _ in streams] == [200] * n and all("[DONE]" in t for _, t in streams), streams
        seen: dict[int, dict[str, Any]] = {}
        for _ in range(200):
            st, got = await fresh("GET", base + "/v1/fleet")
            assert st == 200, got
            seen[got["worker"]] = got["latency"]
            if len(seen) == 2:
                break
        assert len(seen) == 2, "both workers answered /v1/fleet"
        answered = [(await health_per_worker(base))[k]["worker"]["answered"] for k in (0, 1)]
        assert all(a.get("/v1/completions 200") for a in answered), answered  # both proxied some
        for lat in seen.values():
            ttft = sum(t["observations"]["ttft"] for t in lat["targets"].values())
            assert ttft == n and all(t["shared"] for t in lat["targets"].values()), lat
        assert seen[0]["targets"] == seen[1]["targets"]
