"""Driving a workload through a real HTTP endpoint (the gateway, or one vLLM) and recording what each
request saw: time to first token, end-to-end latency, prompt and cached tokens as vLLM reported them, and
the instance the gateway chose.  Used by ``kvrouter demo`` and by the live-vs-simulation agreement check.

Open loop (requests at their arrival times) or closed loop (N clients, the next request as soon as one
finishes); streaming with ``include_usage``, so ``cached_tokens`` comes from vLLM's own usage report.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import aiohttp
import msgspec

from kvrouter.api.usage import read_usage
from kvrouter.lab.workloads.live import http_call
from kvrouter.lab.workloads.spec import Workload


class LiveRecord(msgspec.Struct):
    id: str
    status: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    instance: str | None = None
    reason: str | None = None
    """The gateway's ``x-kvrouter-reason`` (cache, load, spill, ...)."""
    predicted_cached_tokens: int | None = None
    """The gateway's ``x-kvrouter-cached-tokens``: what it expected the instance to serve from cache."""
    base: str = ""
    """The router the request was sent to."""
    sent_s: float = 0.0
    """When it was sent, seconds from the start of the drive."""
    decision_ms: float | None = None
    error: str | None = None


def _usage(line: bytes, rec: LiveRecord) -> None:
    if b'"usage"' not in line:
        return
    try:
        obj = msgspec.json.decode(line[6:])
    except msgspec.DecodeError:
        return
    u = read_usage(obj)
    if u is not None:
        rec.prompt_tokens = u.prompt_tokens or 0
        rec.output_tokens = u.completion_tokens or 0
        rec.cached_tokens = u.cached_tokens or 0


async def one(
    session: aiohttp.ClientSession, base: str, wl: Workload, idx: int, model: str, epoch: float = 0.0
) -> LiveRecord:
    req = wl.requests[idx]
    call = http_call(req, wl.token_space, model=model, stream=True)
    rec = LiveRecord(req.id, base=base)
    t0 = time.perf_counter()
    rec.sent_s = t0 - epoch if epoch else 0.0
    try:
        async with session.post(base + call.path, json=call.body, headers=call.headers) as r:
            rec.status = r.status
            rec.instance = r.headers.get("x-kvrouter-instance")
            rec.reason = r.headers.get("x-kvrouter-reason")
            predicted = r.headers.get("x-kvrouter-cached-tokens")
            rec.predicted_cached_tokens = int(predicted) if predicted and predicted.isdigit() else None
            dm = r.headers.get("x-kvrouter-decision-ms")
            rec.decision_ms = float(dm) if dm else None
            if r.status != 200:
                rec.error = (await r.text())[:200]
                return rec
            buf = b""
            async for chunk in r.content.iter_any():
                buf += chunk
                *lines, buf = buf.split(b"\n\n")
                for line in lines:
                    # The first event after the role-only one carries the first token, whatever its text
                    # (a token that decodes to nothing yet, as a random-weight model's often do, counts).
                    if rec.ttft_s is None and line.startswith(b"data: {") and b'"role"' not in line:
                        rec.ttft_s = time.perf_counter() - t0
                    _usage(line, rec)
            rec.e2e_s = time.perf_counter() - t0
    except (aiohttp.ClientError, TimeoutError) as e:
        rec.error = repr(e)
    return rec


async def drive(
    base: str | Sequence[str],
    wl: Workload,
    *,
    model: str,
    concurrency: int | None = None,
    progress: Callable[[int], None] | None = None,
    timeout_s: float = 600.0,
    fresh_connections: bool = False,
) -> list[LiveRecord]:
    """Send every request of ``wl`` to ``base``; closed loop with ``concurrency`` clients if given, else
    at the workload's arrival times.  Several bases (router replicas behind a round-robin balancer):
    request ``i`` of the workload goes to ``base[i % len(base)]``.  ``fresh_connections``: each request on a
    connection of its own (a gateway of several workers on one port: the kernel picks the worker of every
    request)."""
    bases = [base] if isinstance(base, str) else list(base)
    if not bases:
        raise ValueError("drive needs at least one base URL")
    n = len(wl.requests)
    out: list[LiveRecord | None] = [None] * n
    conn = aiohttp.TCPConnector(limit=0, force_close=fresh_connections)
    epoch = time.perf_counter()
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:

        async def run(i: int) -> None:
            out[i] = await one(s, bases[i % len(bases)], wl, i, model, epoch)
            if progress:
                progress(1)

        if concurrency:
            nxt = 0

            async def client() -> None:
                nonlocal nxt
                while nxt < n:
                    i, nxt = nxt, nxt + 1
                    await run(i)

            await asyncio.gather(*(client() for _ in range(concurrency)))
        else:
            t0 = time.perf_counter()
            tasks = []
            for i, r in enumerate(wl.requests):
                delay = (r.arrival_s or 0.0) - (time.perf_counter() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(run(i)))
            await asyncio.gather(*tasks)
    return [r for r in out if r is not None]
