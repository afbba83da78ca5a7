"""An open-loop HTTP load driver: requests at a fixed rate whatever the answers, every answer recorded.

::

    t0 ─┬─ request 0 ─┬─ request 1 ─┬─ ...        sent at t0 + i / rate (open loop: a slow server gets
        │             │             │            more requests in flight, never fewer requests)
        └── Shot(sent, status, latency, decision ms, Retry-After, instance, error)

Outstanding requests are bounded (``max_outstanding``): past it a request is not sent and is recorded as
``client_overload``, so a stuck server cannot make the driver itself grow without bound.  The open loop
sends through the gateway's own lean client (``UpstreamHttp``, keep-alive pooled), not aiohttp's: at 4R
the driver shares the machine with the gateway, and a driver that spends more CPU per request than the
gateway refusing it measures itself (docs/reliability.md, "The driver").
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
import msgspec

from kvrouter.gateway.upstream_http import UpstreamHttp
from kvrouter.lab.reliability.stack import MODEL, cached_tokens
from kvrouter.percentiles import quantile


class Shot(msgspec.Struct, gc=False):
    sent: float
    """Seconds after the phase started."""
    status: int = 0
    latency_s: float = 0.0
    decision_ms: float | None = None
    retry_after: str | None = None
    instance: str | None = None
    error: str | None = None
    cached_tokens: int = 0


_TOKEN_IDS = range(100, 30_000)


class PromptMix:
    """Completion bodies over a few shared prefixes (token ids, so nothing is tokenized on the way)."""

    def __init__(
        self, seed: int, *, groups: int = 16, prefix: int = 256, tail: int = 32, max_tokens: int = 4
    ):
        rng = random.Random(seed)
        self.rng = rng
        self.prefixes = [[rng.randrange(100, 30_000) for _ in range(prefix)] for _ in range(groups)]
        self.tail = tail
        self.max_tokens = max_tokens

    def body(self) -> dict[str, Any]:
        r = self.rng
        # (``choices``: one draw per token at a fraction of ``randrange``'s cost, which was a fifth of the
        # driver's CPU per request at 4R)
        tokens = [*r.choice(self.prefixes), *r.choices(_TOKEN_IDS, k=self.tail)]
        return {"model": MODEL, "prompt": tokens, "max_tokens": self.max_tokens, "ignore_eos": True}


def _record(shot: Shot, status: int, headers: Mapping[str, str], data: bytes) -> None:
    """An answer's fields into ``shot``; ``headers`` looked up by lower-case name (aiohttp's are
    case-insensitive, the lean client's are given lowered)."""
    shot.status = status
    shot.retry_after = headers.get("retry-after")
    shot.instance = headers.get("x-kvrouter-instance")
    dm = headers.get("x-kvrouter-decision-ms")
    shot.decision_ms = float(dm) if dm else None
    if status == 200 and b"cached_tokens" in data:
        shot.cached_tokens = cached_tokens(msgspec.json.decode(data))


async def one(session: aiohttp.ClientSession, url: str, body: dict[str, Any], shot: Shot) -> None:
    t0 = time.perf_counter()
    try:
        async with session.post(url, json=body) as r:
            _record(shot, r.status, r.headers, await r.read())
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        shot.error = type(e).__name__
    shot.latency_s = time.perf_counter() - t0


_JSON = {"Content-Type": "application/json"}
TIMEOUT_S = 30.0
"""A request without its answer this long (connecting, or between two reads of its answer) has failed."""


async def lean_one(client: UpstreamHttp, url: str, body: dict[str, Any], shot: Shot) -> None:
    """``one`` through the lean client: the same fields recorded, the same exception names on failure."""
    t0 = time.perf_counter()
    try:
        data = msgspec.json.encode(body)
        ans = await client.post(url, data, _JSON, connect_timeout=TIMEOUT_S, read_timeout=TIMEOUT_S)
        try:
            raw = await ans.read()
        finally:
            ans.release()
        _record(shot, ans.status, {k.lower(): v for k, v in ans.headers.items()}, raw)
    except (aiohttp.ClientError, TimeoutError, ValueError, OSError) as e:
        shot.error = type(e).__name__
    shot.latency_s = time.perf_counter() - t0


async def open_loop(
    client: UpstreamHttp,
    urls: list[str],
    rate: float,
    duration_s: float,
    body: Callable[[], dict[str, Any]],
    *,
    max_outstanding: int = 2000,
) -> list[Shot]:
    """Send ``rate`` requests per second for ``duration_s`` (to ``urls`` in turn); wait for every answer."""
    n = max(1, int(rate * duration_s))
    shots: list[Shot] = []
    tasks: set[asyncio.Task[None]] = set()
    t0 = time.perf_counter()
    for i in range(n):
        at = i / rate
        delay = at - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        shot = Shot(sent=time.perf_counter() - t0)
        shots.append(shot)
        if len(tasks) >= max_outstanding:
            shot.error = "client_overload"
            continue
        task = asyncio.create_task(lean_one(client, urls[i % len(urls)], body(), shot))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.gather(*tasks)
    return shots


def error_kinds(shots: list[Shot]) -> dict[str, int]:
    """Failed shots by kind: the client's exception name, ``client_overload``, or ``status_<code>``."""
    out: dict[str, int] = {}
    for s in shots:
        kind = s.error or (f"status_{s.status}" if s.status not in (200, 429) else None)
        if kind:
            out[kind] = out.get(kind, 0) + 1
    return out


def summary(shots: list[Shot], duration_s: float) -> dict[str, float]:
    ok = [s for s in shots if s.status == 200 and s.error is None]
    lat = [s.latency_s for s in ok]
    dec = [s.decision_ms for s in ok if s.decision_ms is not None]
    return {
        "sent": len(shots),
        "ok": len(ok),
        "errors": sum(1 for s in shots if (s.status not in (200, 429)) or s.error is not None),
        "r429": sum(1 for s in shots if s.status == 429),
        "rate_ok": len(ok) / duration_s if duration_s else 0.0,
        "p50_ms": quantile(lat, 0.5) * 1e3,
        "p99_ms": quantile(lat, 0.99) * 1e3,
        "max_ms": (max(lat) if lat else float("nan")) * 1e3,
        "decision_p50_ms": quantile(dec, 0.5),
        "decision_p99_ms": quantile(dec, 0.99),
    }
