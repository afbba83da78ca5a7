"""What a shared index would add to every request: the round trip from a worker to one ingesting process.

``kvrouter serve --workers N`` could hold the index once (one process ingesting the KV events, the workers
asking it for every request's cached prefix) or N times (every worker subscribed, its own index).  The
shared design saves the index's memory and the other workers' ingestion CPU, and adds one inter-process
round trip to every routed request.  This measures that round trip as the workers would make it: an
asyncio client writes a lookup-sized request (the block hashes of an 8k-token prompt, 512 x 8 bytes) over
a Unix socket, a server process on its own event loop answers a result-sized reply (matched blocks per
instance).  The server does no lookup at all: the figures are the transport's cost alone, a lower bound.

``python -m kvrouter.lab.bench.workers_bench`` (JSON): latency p50 / p99 and CPU per round trip (both
processes), against which to set the in-process lookup (``kvrouter bench routing``) and the index's
memory and ingest rate (``kvrouter bench indexer``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import struct
import tempfile
import time
from multiprocessing import get_context
from pathlib import Path
from typing import Any

REQUEST_BYTES = 512 * 8
REPLY_BYTES = 8 * 16


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--n", type=int, default=5000, help="round trips")
    ap.add_argument("--blocks", type=int, default=512, help="block hashes per request")
    ap.add_argument(
        "--memory-workers", default="1,2,4", help="kvrouter serve --workers counts whose memory to measure"
    )


def serve_memory(workers: int, settle_s: float = 3.0) -> dict[str, Any]:
    """The host's memory for ``kvrouter serve --workers workers`` once started (the fleet's tokenizer
    loaded, no traffic): RSS summed over the processes (shared pages counted in each), PSS summed (each
    shared page counted once, divided among its processes: the host's real cost)."""
    import subprocess
    import sys
    import urllib.request

    from kvrouter.lab.bench.gateway_bench import free_ports
    from kvrouter.lab.bench.proctree import descendants, memory_kb
    from tokenizer_cache import default_tokenizer_path

    with tempfile.TemporaryDirectory() as tmp:
        fleet = Path(tmp) / "fleet.json"
        dead = free_ports(range(4))  # nothing listens there: memory at start, not under load
        fleet.write_text(
            json.dumps(
                {
                    "block_size": 16,
                    "tokenizer": default_tokenizer_path(),
                    "instances": [{"name": f"i{k}", "url": f"http://127.0.0.1:{dead + k}"} for k in range(4)],
                }
            )
        )
        port = free_ports((0,))
        argv = [sys.executable, "-m", "kvrouter.cli", "--log-level", "ERROR", "serve", "--fleet", str(fleet)]
        argv += ["--port", str(port), "--workers", str(workers), "--no-events"]
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                procs = descendants(proc.pid)
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/livez", timeout=1) as r:
                        up = r.status == 200
                except OSError:
                    up = False
                if up and len(procs) == workers + (workers > 1):
                    break
                time.sleep(0.2)
            time.sleep(settle_s)
            mem = [memory_kb(p) for p in descendants(proc.pid)]
        finally:
            proc.terminate()
            proc.wait(20)
    return {
        "workers": workers,
        "processes": len(mem),
        "rss_sum_mb": round(sum(m[0] for m in mem) / 1024, 1),
        "pss_sum_mb": round(sum(m[1] for m in mem) / 1024, 1),
    }


def _serve(path: str, blocks: int) -> None:
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        reply = bytes(REPLY_BYTES)
        try:
            while True:
                await r.readexactly(blocks * 8)
                w.write(reply)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            w.close()

    async def main() -> None:
        server = await asyncio.start_unix_server(handle, path)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


async def _client(path: str, n: int, blocks: int) -> list[float]:
    r, w = await asyncio.open_unix_connection(path)
    payload = struct.pack(f"<{blocks}Q", *range(blocks))
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        w.write(payload)
        await r.readexactly(REPLY_BYTES)
        out.append(time.perf_counter() - t0)
    w.close()
    return out


def main(a: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"index_round_trip": round_trip(a)}
    if a.memory_workers:
        mem = [serve_memory(int(w)) for w in a.memory_workers.split(",")]
        base = mem[0]["pss_sum_mb"]
        for m in mem:
            m["pss_over_first"] = round(m["pss_sum_mb"] / base, 2) if base else None
        out["serve_memory"] = mem
    return out


def round_trip(a: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "index.sock")
        server = get_context("spawn").Process(target=_serve, args=(path, a.blocks), daemon=True)
        server.start()
        try:
            for _ in range(200):
                if os.path.exists(path):
                    break
                time.sleep(0.05)
            asyncio.run(_client(path, 200, a.blocks))  # warm-up
            assert server.pid is not None
            s0 = _cpu_s(server.pid)
            c0 = resource.getrusage(resource.RUSAGE_SELF)
            lat = sorted(asyncio.run(_client(path, a.n, a.blocks)))
            c1 = resource.getrusage(resource.RUSAGE_SELF)
            s1 = _cpu_s(server.pid)
        finally:
            server.terminate()
            server.join(5)
    client_cpu = (c1.ru_utime + c1.ru_stime) - (c0.ru_utime + c0.ru_stime)
    return {
        "round_trips": a.n,
        "request_bytes": a.blocks * 8,
        "reply_bytes": REPLY_BYTES,
        "latency_p50_us": round(lat[len(lat) // 2] * 1e6, 1),
        "latency_p99_us": round(lat[int(len(lat) * 0.99)] * 1e6, 1),
        "cpu_us_per_round_trip_client": round(client_cpu * 1e6 / a.n, 1),
        "cpu_us_per_round_trip_server": round((s1 - s0) * 1e6 / a.n, 1),
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    add_args(ap)
    print(json.dumps(main(ap.parse_args()), indent=1))
