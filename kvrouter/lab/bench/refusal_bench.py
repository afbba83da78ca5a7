"""What a refusal costs the gateway: CPU per request answered 429 against CPU per request served, in one
run, on one ``kvrouter serve --workers 1`` in front of a simulated instance.

::

    kvrouter sim (1 instance) ◀── kvrouter serve --workers 1 (limits.max_requests = cap)
                                     ▲ CPU: /proc/<pid>/stat before and after each phase
    raw HTTP/1.1 client, `connections` keep-alive connections, one request at a time each
    floor     GET /livez: what the HTTP server costs per request before any handler work
    served    the instance answers at once: every request routed, proxied, answered 200
    refused   the instance holds every request: `cap` requests fill the gateway, then every request
              is refused (429 + Retry-After) before its body is read

The gateway's CPU is read from the kernel, so the client's own cost is not in the figures
(docs/results.md, "How the benches measure").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from kvrouter.lab.reliability.driver import PromptMix
from kvrouter.lab.reliability.procs import ServeProcess, SimProcess, metric
from kvrouter.lab.reliability.stack import merge
from kvrouter.percentiles import quantile

TARGET_RATIO = 0.15
"""A refusal may cost at most this share of a served request's CPU."""


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--refusal-n", type=int, default=20_000, help="requests per phase")
    ap.add_argument("--connections", type=int, default=16, help="client keep-alive connections")
    ap.add_argument("--cap", type=int, default=32, help="limits.max_requests of the gateway")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def livez_bytes(port: int) -> bytes:
    return f"GET /livez HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()


def request_bytes(port: int, body: dict[str, Any]) -> bytes:
    raw = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(raw)}\r\n\r\n"
    )
    return head.encode() + raw


async def _one_connection(port: int, payloads: list[bytes], out: list[tuple[int, float, bool]]) -> None:
    """Send ``payloads`` one at a time on one keep-alive connection; (status, seconds, Retry-After)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for p in payloads:
            t0 = time.perf_counter()
            writer.write(p)
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split()[1])
            headers = {
                k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)
            }
            await reader.readexactly(int(headers.get("content-length", "0")))
            out.append((status, time.perf_counter() - t0, "retry-after" in headers))
            if headers.get("connection", "").lower() == "close":
                writer.close()
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
    finally:
        writer.close()


async def closed_loop(port: int, payloads: list[bytes], connections: int) -> list[tuple[int, float, bool]]:
    out: list[tuple[int, float, bool]] = []
    share = [payloads[i::connections] for i in range(connections)]
    await asyncio.gather(*(_one_connection(port, s, out) for s in share if s))
    return out


def _phase(pid: int, port: int, payloads: list[bytes], connections: int) -> dict[str, Any]:
    c0, t0 = cpu_s(pid), time.perf_counter()
    shots = asyncio.run(closed_loop(port, payloads, connections))
    cpu, wall = cpu_s(pid) - c0, time.perf_counter() - t0
    by_status: dict[str, int] = {}
    for status, _, _ in shots:
        by_status[str(status)] = by_status.get(str(status), 0) + 1
    lat = [s for _, s, _ in shots]
    return {
        "requests": len(shots),
        "by_status": by_status,
        "with_retry_after": sum(1 for _, _, ra in shots if ra),
        "gateway_cpu_s": round(cpu, 3),
        "wall_s": round(wall, 3),
        "rate": round(len(shots) / wall, 1),
        "cpu_us_per_req": round(cpu * 1e6 / max(1, len(shots)), 1),
        "latency_p50_ms": round(quantile(lat, 0.5) * 1e3, 3),
        "latency_p99_ms": round(quantile(lat, 0.99) * 1e3, 3),
    }


async def _faults(url: str, latency_s: float) -> None:
    async with aiohttp.ClientSession() as s, s.post(f"{url}/sim/faults", json={"latency_s": latency_s}) as r:
        await r.read()
        if r.status != 200:
            raise RuntimeError(f"fault update refused: {r.status}")


async def _fill(port: int, body: bytes, cap: int) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """``cap`` requests the instance holds: the gateway is full once they are in."""
    conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(cap)]
    for _, w in conns:
        w.write(body)
        await w.drain()
    return conns


def main(a: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="kvrouter-bench-refusal-"))
    log = (workdir / "processes.log").open("wb")
    sim = SimProcess(workdir, log, "--instances", "1", "--profile", "test", "--answer-tokens", "0")
    gw: ServeProcess | None = None
    try:
        fleet = asyncio.run(sim.start())
        url = fleet["instances"][0]["url"]
        cfg = merge(fleet, {"limits": {"max_requests": a.cap}, "routing": {"shadow": False}})
        gw = ServeProcess("serve", cfg, workdir, log, "gateway", 1)
        asyncio.run(gw.start())
        mix = PromptMix(0, max_tokens=1)
        payloads = [request_bytes(gw.port, mix.body()) for _ in range(a.refusal_n)]
        _phase(gw.proc.pid, gw.port, payloads[: min(2000, len(payloads))], a.connections)  # warm-up
        floor = _phase(gw.proc.pid, gw.port, [livez_bytes(gw.port)] * len(payloads), a.connections)
        served = _phase(gw.proc.pid, gw.port, payloads, a.connections)
        refused = asyncio.run(_refused(gw, url, payloads, a))
    finally:
        if gw is not None:
            gw.stop()
        sim.stop()
        log.close()
    ratio = refused["cpu_us_per_req"] / served["cpu_us_per_req"] if served["cpu_us_per_req"] else None
    ok = (
        ratio is not None
        and ratio <= TARGET_RATIO
        and refused["by_status"].get("429", 0) == refused["requests"]
        and refused["with_retry_after"] == refused["requests"]
    )
    return {
        "floor_livez": floor,
        "served": served,
        "refused": refused,
        "refusal_over_served_cpu": None if ratio is None else round(ratio, 3),
        "target": f"refusal CPU <= {TARGET_RATIO} x served CPU, every refusal a 429 with Retry-After",
        "ok": ok,
    }


async def _refused(
    gw: ServeProcess, url: str, payloads: list[bytes], a: argparse.Namespace
) -> dict[str, Any]:
    await _faults(url, 3600.0)
    held = await _fill(gw.port, payloads[0], a.cap)
    try:
        # the gateway is full once every held request reached the instance
        async with aiohttp.ClientSession() as s:
            for _ in range(1000):
                if await metric(s, gw.base, "kvrouter_instance_in_flight") >= a.cap:
                    break
                await asyncio.sleep(0.02)
            else:
                raise RuntimeError(f"the gateway never held {a.cap} requests")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, _phase, gw.proc.pid, gw.port, payloads, a.connections)
    finally:
        for _, w in held:
            w.close()
        await _faults(url, 0.0)
