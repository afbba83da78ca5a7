"""Which server in front: the lean core, aiohttp and granian doing the same pass-through, CPU per request.

::

    client (32 in flight, 9 KB-body POSTs) ──▶ server S ──UpstreamHttp (the gateway's client)──▶ fake worker
    S = lean     the gateway's lean core protocol (``gateway.lean``), its handler a bare pass-through
        aiohttp  an aiohttp handler doing the same
        granian  an RSGI app doing the same (granian 2: Rust HTTP server, one worker, one runtime thread,
                 uvloop; not a dependency: ``pip install granian`` to measure it)

No routing, no tokenizing: only the server's cost around one upstream request differs.  CPU per request
is the server's process tree's ``/proc`` CPU over the measured requests (granian's Rust threads
included), run one after another on the same fake worker.
``python -m kvrouter.lab.bench.front_servers [--n N]`` prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvrouter.lab.bench.common import peer_python, peerbench_dir
from kvrouter.lab.bench.proctree import cpu_s, descendants

_UPSTREAM_ENV = "KVROUTER_FRONT_BENCH_UPSTREAM"
_BODY = json.dumps({"model": "fake-model", "prompt": "word " * 1800, "max_tokens": 8}).encode()


def _upstream() -> tuple[Any, str]:
    from kvrouter.gateway.upstream_http import UpstreamHttp

    return UpstreamHttp(), os.environ[_UPSTREAM_ENV] + "/v1/completions"


_HEADERS = {"content-type": "application/json"}


# ---------------------------------------------------------------------------------------------- granian
_rsgi_state: dict[str, Any] = {}


async def rsgi_app(scope: Any, proto: Any) -> None:
    """The pass-through as an RSGI app (``granian --interface rsgi ...front_servers:rsgi_app``)."""
    if not _rsgi_state:
        _rsgi_state["http"], _rsgi_state["url"] = _upstream()
    body = await proto()
    resp = await _rsgi_state["http"].post(
        _rsgi_state["url"], body, _HEADERS, connect_timeout=2, read_timeout=30
    )
    data = await resp.read()
    resp.release()
    proto.response_bytes(resp.status, [("content-type", "application/json")], data)


# ---------------------------------------------------------------------------------------------- aiohttp
def serve_aiohttp(port: int) -> None:
    from aiohttp import web

    http, url = _upstream()

    async def handler(request: web.Request) -> web.Response:
        body = await request.read()
        resp = await http.post(url, body, _HEADERS, connect_timeout=2, read_timeout=30)
        data = await resp.read()
        resp.release()
        return web.Response(body=data, status=resp.status, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


# ---------------------------------------------------------------------------------------------- lean
def serve_lean(port: int) -> None:
    from kvrouter.gateway.lean.exchange import Exchange
    from kvrouter.gateway.lean.protocol import LeanProtocol
    from kvrouter.gateway.lean.routes import lean_routes

    http, url = _upstream()

    class PassThrough:
        """What ``LeanProtocol`` reads of its core, with a handler that only forwards."""

        def __init__(self) -> None:
            self.loop = asyncio.get_running_loop()
            self.routes = lean_routes()
            self.max_body = 32 << 20
            self.conns: set[LeanProtocol] = set()

        def aiohttp_protocol(self) -> asyncio.Protocol:
            raise RuntimeError("no other routes here")

        async def handle(self, ex: Exchange) -> None:
            try:
                resp = await http.post(url, await ex.read(), _HEADERS, connect_timeout=2, read_timeout=30)
                data = await resp.read()
                resp.release()
                ex.answer(resp.status, {"content-type": "application/json"}, data)
            finally:
                ex.conn.done(ex)

    async def main() -> None:
        core = PassThrough()
        server = await asyncio.get_running_loop().create_server(
            lambda: LeanProtocol(core),  # type: ignore[arg-type]
            "127.0.0.1",
            port,
        )
        async with server:
            await server.serve_forever()

    import uvloop

    uvloop.run(main())


# ---------------------------------------------------------------------------------------------- driver
async def _drive(url: str, n: int, conc: int, root: int) -> dict[str, Any]:
    import aiohttp

    sem = asyncio.Semaphore(conc)
    errors = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=conc)) as s:

        async def one() -> None:
            nonlocal errors
            async with sem, s.post(url, data=_BODY, headers=_HEADERS) as r:
                await r.read()
                errors += r.status != 200

        await asyncio.gather(*(one() for _ in range(min(n, 300))))

        def tree_cpu() -> float:
            return sum(cpu_s(p) or 0.0 for p in descendants(root))

        c0, t0 = tree_cpu(), time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        c1, t1 = tree_cpu(), time.perf_counter()
    return {"cpu_ms_per_req": round((c1 - c0) * 1e3 / n, 4), "rps": round(n / (t1 - t0), 1), "errors": errors}


def _ready(url: str, timeout: float = 60) -> bool:
    import urllib.request

    end = time.time() + timeout
    while time.time() < end:
        try:
            req = urllib.request.Request(url, data=_BODY, headers=_HEADERS)
            with urllib.request.urlopen(req, timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            time.sleep(0.2)
    return False


def main(a: argparse.Namespace) -> dict[str, Any]:
    from kvrouter.lab.bench.gateway_bench import free_ports

    d, py = peerbench_dir(), peer_python("bench")
    if d is None or py is None:
        return {"skipped": "shared/peerbench or its venvs missing"}
    wport = free_ports((0,))
    fake_workers = subprocess.Popen(
        [str(py), str(Path(d) / "fakeworker.py"), "--ports", str(wport)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    env = {**os.environ, _UPSTREAM_ENV: f"http://127.0.0.1:{wport}"}
    out: dict[str, Any] = {"n": a.n, "concurrency": a.concurrency}
    try:
        for name in a.servers.split(","):
            port = free_ports((0,))
            here = "kvrouter.lab.bench.front_servers"
            cmd = {
                "lean": [sys.executable, "-c", f"from {here} import serve_lean; serve_lean({port})"],
                "aiohttp": [sys.executable, "-c", f"from {here} import serve_aiohttp; serve_aiohttp({port})"],
                "granian": [
                    str(Path(sys.executable).parent / "granian"),
                    "--interface", "rsgi", "--workers", "1", "--runtime-threads", "1",
                    "--loop", "uvloop", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
                    f"{here}:rsgi_app",
                ],
            }[name]  # fmt: skip
            if not Path(cmd[0]).exists():
                out[name] = {"skipped": f"{cmd[0]} is not installed (pip install granian)"}
                continue
            p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                url = f"http://127.0.0.1:{port}/v1/completions"
                if not _ready(url):
                    out[name] = {"skipped": "did not start"}
                    continue
                out[name] = asyncio.run(_drive(url, a.n, a.concurrency, p.pid))
            finally:
                p.send_signal(signal.SIGINT)
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
    finally:
        fake_workers.terminate()
        fake_workers.wait(timeout=20)
    lean = out.get("lean", {}).get("cpu_ms_per_req")
    out["cpu_over_lean"] = {
        k: round(v["cpu_ms_per_req"] / lean, 3)
        for k, v in out.items()
        if isinstance(v, dict) and v.get("cpu_ms_per_req") and lean
    }
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--servers", default="lean,aiohttp,granian")
    print(json.dumps(main(ap.parse_args()), indent=1))
