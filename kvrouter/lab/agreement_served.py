"""The live half of ``kvrouter agreement --workers N``: the gateway as ``kvrouter serve --workers N`` (a
process tree, as deployed) instead of in this process.

::

    SimFleet (this process) ◀── kvrouter serve --workers N (child) ◀── load generator (this process),
                                  every worker subscribed             one fresh connection per request

Before the workload starts, every worker must have subscribed to every instance's KV events (events
published before are lost to it): /health is asked on fresh connections until each worker has answered
with every source connected.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from kvrouter.lab.loadgen import LiveRecord, drive
from kvrouter.lab.workloads.spec import Workload


async def drive_served(
    fleet: dict[str, Any], workers: int, wl: Workload, model: str, concurrency: int
) -> tuple[list[LiveRecord], float, dict[str, int]]:
    """Start ``kvrouter serve --workers workers`` on ``fleet``, wait for it, drive ``wl``; returns the
    records, the wall time of the drive and the completions each worker answered."""
    with tempfile.TemporaryDirectory(prefix="kvrouter-agreement-") as tmp:
        path = Path(tmp) / "fleet.yaml"
        path.write_text(json.dumps(fleet))  # JSON is YAML; str enums (policy names) encode as strings
        port = _free_port()
        argv = [sys.executable, "-m", "kvrouter.cli", "--log-level", "WARNING", "serve", "--fleet", str(path)]
        argv += ["--port", str(port), "--workers", str(workers)]
        log = (Path(tmp) / "serve.log").open("wb")
        proc = subprocess.Popen(argv, stdout=log, stderr=log)
        base = f"http://127.0.0.1:{port}"
        try:
            await _until_subscribed(base, workers, len(fleet["instances"]), proc, Path(tmp) / "serve.log")
            t0 = time.perf_counter()
            recs = await drive(base, wl, model=model, concurrency=concurrency, fresh_connections=True)
            wall = time.perf_counter() - t0
            return recs, wall, await _answered(base, workers)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
            log.close()


async def _until_subscribed(
    base: str, workers: int, sources: int, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 120
) -> None:
    ready: set[object] = set()
    deadline = time.monotonic() + timeout_s
    while len(ready) < workers:
        if proc.poll() is not None:
            raise OSError(f"kvrouter serve exited: {log.read_text()[-2000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"only workers {sorted(map(str, ready))} of {workers} subscribed in time")
        try:
            conn = aiohttp.TCPConnector(force_close=True)
            async with aiohttp.ClientSession(connector=conn) as s, s.get(base + "/health") as r:
                body = await r.json()
        except (aiohttp.ClientError, ValueError):
            await asyncio.sleep(0.2)
            continue
        index = body.get("index", [])
        if len(index) >= sources and all(x.get("connected") for x in index):
            ready.add((body.get("worker") or {}).get("worker", 0))
        else:
            await asyncio.sleep(0.05)


async def _answered(base: str, workers: int, tries: int = 200) -> dict[str, int]:
    """Chat completions answered 200 by each worker (its /health, which counts its own answers; /metrics
    shows the host's sums), on fresh connections until every worker has answered once."""
    out: dict[str, int] = {}
    for _ in range(tries):
        conn = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=conn) as s, s.get(base + "/health") as r:
            body = await r.json(content_type=None)
        w = body.get("worker") or {}
        n = sum(v for k, v in (w.get("answered") or {}).items() if "completions" in k and k.endswith(" 200"))
        out.setdefault(str(w.get("worker", 0)), n)
        if len(out) >= workers:
            break
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
