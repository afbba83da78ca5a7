"""CPU per request of tracing, measured A/B in routers that keep running (``kvrouter bench gateway
--tracing-ab ROUNDS``): the machine's load drifts over minutes, so phases of a few seconds, interleaved,
see the same load where separate runs would not.

Two routers in front of peerbench's fake workers: OFF (tracing off) and ON (``OTEL_TRACES_EXPORTER=otlp``,
sampler ``parentbased_always_off``, spans to an OTLP receiver here).  Each round runs OFF, then ON with
no traceparent, with an unsampled one and with a sampled one; each phase sends N chat requests, 8
concurrent, and reads the on-CPU time of every router thread (``/proc/PID/task/*/schedstat``) / N.

CPU counts the router's whole process tree: the span exporter's process is the router's cost too (its
part is also reported alone).  Reported: the median over rounds of each phase's CPU per request, and of
its difference from the same round's OFF phase (another process) and ON-none phase (the same process:
what tracing adds to a request).
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from tokenizer_cache import default_tokenizer_path

from .otlp_sink import OtlpSink

_MODEL = "fake-model"


def on_cpu_ns(pid: int) -> int:
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (the router's span exporter, its workers), as now."""
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/children") as f:
                    kids = [int(x) for x in f.read().split()]
            except (OSError, ValueError):
                continue
            out += kids
            todo += kids
    return out


def tree_cpu_ns(pid: int) -> tuple[int, int]:
    """On-CPU time of the router's own process and of the processes below it (its span exporter)."""
    return on_cpu_ns(pid), sum(on_cpu_ns(k) for k in descendants(pid))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _ready(url: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError(url)


def _traceparent(rng: random.Random, sampled: bool) -> str:
    return f"00-{rng.getrandbits(128):032x}-{rng.getrandbits(64):016x}-{'01' if sampled else '00'}"


async def _phase(
    base: str, pid: int, n: int, mode: str, rng: random.Random, system: str
) -> tuple[float, float]:
    """CPU ns per request of ``n`` chat requests, 8 at a time: the router's process tree, and the part of
    it in the processes below the router (its span exporter)."""
    sem = asyncio.Semaphore(8)
    conn = aiohttp.TCPConnector(limit=8)
    async with aiohttp.ClientSession(connector=conn) as s:

        async def one(i: int) -> None:
            h = {} if mode in ("off", "none") else {"traceparent": _traceparent(rng, mode == "sampled")}
            body = {
                "model": _MODEL,
                "max_tokens": 8,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"q {i}"}],
            }
            async with sem, s.post(base + "/v1/chat/completions", json=body, headers=h) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"status {r.status}")

        await asyncio.gather(*(one(i) for i in range(50)))  # warm connections, outside the count
        kids0 = descendants(pid)
        own0, below0 = tree_cpu_ns(pid)
        await asyncio.gather(*(one(i) for i in range(n)))
        own1, below1 = tree_cpu_ns(pid)
        # an exporter started during the phase counts from zero; one that ended is not subtracted
        below0 -= sum(on_cpu_ns(k) for k in kids0 if k not in descendants(pid))
        below = (below1 - below0) / n
        return (own1 - own0) / n + below, below


def tracing_ab(rounds: int, n: int, peer_python: Path, fakeworker: Path) -> dict[str, Any]:
    ports = [_free_port() for _ in range(4)]
    tmp = Path(tempfile.mkdtemp(prefix="kvrouter-tracing-ab-"))
    fleet = tmp / "fleet.yaml"
    lines = ["block_size: 16", f"tokenizer: {default_tokenizer_path()}", "instances:"]
    lines += [f"  - name: w{i}\n    url: http://127.0.0.1:{p}" for i, p in enumerate(ports)]
    fleet.write_text("\n".join(lines) + "\n")
    sink = OtlpSink()
    endpoint = sink.start()
    procs: list[subprocess.Popen[bytes]] = []
    log = open(tmp / "log.txt", "wb")  # noqa: SIM115 - closed in the finally
    try:
        procs.append(
            subprocess.Popen(
                [str(peer_python), str(fakeworker), "--ports", *map(str, ports)], stdout=log, stderr=log
            )
        )
        routers = {}
        for name, env in (
            ("off", {}),
            (
                "on",
                {
                    "OTEL_TRACES_EXPORTER": "otlp",
                    "OTEL_TRACES_SAMPLER": "parentbased_always_off",
                    "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
                },
            ),
        ):
            port = _free_port()
            cmd = [
                sys.executable,
                "-m",
                "kvrouter.cli",
                "--log-level",
                "WARNING",
                "serve",
                "--fleet",
                str(fleet),
            ]
            cmd += ["--port", str(port), "--workers", "1"]
            p = subprocess.Popen(cmd, stdout=log, stderr=log, env={**os.environ, **env})
            procs.append(p)
            routers[name] = (f"http://127.0.0.1:{port}", p.pid)

        async def drive() -> tuple[dict[str, list[float]], dict[str, list[float]]]:
            for base, _ in routers.values():
                await _ready(base + "/livez")
            rng = random.Random(7)
            system = " ".join(f"word{rng.randint(0, 5000)}" for _ in range(300))
            got: dict[str, list[float]] = {"off": [], "none": [], "unsampled": [], "sampled": []}
            below: dict[str, list[float]] = {"off": [], "none": [], "unsampled": [], "sampled": []}
            order = [("off", "off"), ("none", "on"), ("unsampled", "on"), ("sampled", "on")]
            for k in range(rounds):
                for mode, router in order[k % 4 :] + order[: k % 4]:  # each mode first in turn
                    base, pid = routers[router]
                    total, sub = await _phase(base, pid, n, mode, rng, system)
                    got[mode].append(total)
                    below[mode].append(sub)
            return got, below

        got, below = asyncio.run(drive())
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        log.close()
        sink.stop()
    us = {m: [round(v / 1e3, 1) for v in vs] for m, vs in got.items()}
    return {
        "rounds": rounds,
        "requests_per_phase": n,
        "cpu_us_per_req": us,
        "median_cpu_us_per_req": {m: round(statistics.median(v), 1) for m, v in us.items()},
        "median_exporter_process_cpu_us_per_req": {
            m: round(statistics.median(v) / 1e3, 1) for m, v in below.items()
        },
        "added_cpu_us_per_req_paired_median": {
            f"{m}-{base}": round(statistics.median(a - b for a, b in zip(us[m], us[base], strict=True)), 1)
            for m, base in (
                ("none", "off"),
                ("unsampled", "off"),
                ("sampled", "off"),
                ("unsampled", "none"),
                ("sampled", "none"),
            )
        },
        "spans_received": sink.spans,
    }
