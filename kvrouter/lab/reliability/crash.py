"""An instance crashes mid-stream: its streaming clients get a well-formed error event, no other request
fails, new requests avoid it within 2 s, and it returns to rotation once healthy.

::

    streams ──gateway (round-robin)──▶ sim-0  sim-1 ╳ crash (down_s)  sim-2
    background: one short request every 1/rate s, all through the gateway, before, during and after
    watcher:    the gateway's view of the victim (in rotation or not), every 5 ms

A well-formed error event: every ``data:`` line parses as JSON (or is ``[DONE]``), one of them carries
``error.type == "BadGatewayError"``, and the stream ends with ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import msgspec

from kvrouter.lab.reliability.driver import Shot, one
from kvrouter.lab.reliability.figures import Figure, ScenarioResult, at_least, at_most, exactly
from kvrouter.lab.reliability.stack import (
    MODEL,
    Resources,
    ScenarioError,
    cancel_all,
    client,
    set_faults,
    until,
)


class CrashConfig(msgspec.Struct, frozen=True):
    instances: int = 3
    streams: int = 9
    """Concurrent long streams (a third land on the victim)."""
    stream_tokens: int = 3000
    background_rate: float = 25.0
    """Short requests per second through the gateway during the whole scenario."""
    down_s: float = 3.0
    """How long the victim stays down after crashing."""
    avoid_within_s: float = 2.0
    slowdown: float = 3.0
    """Step-time multiplier on every instance, so the streams are still running when the crash comes."""


class StreamOutcome(msgspec.Struct):
    instance: str = ""
    done: bool = False
    """Ended with ``data: [DONE]``."""
    error_event: bool = False
    well_formed: bool = True
    chunks: int = 0


def parse_sse(body: bytes, out: StreamOutcome) -> None:
    """Check every SSE event of a finished stream."""
    events = [e for e in body.split(b"\n\n") if e.strip()]
    for ev in events:
        if not ev.startswith(b"data: "):
            out.well_formed = False
            continue
        data = ev[6:]
        if data == b"[DONE]":
            continue
        try:
            obj = msgspec.json.decode(data)
        except msgspec.DecodeError:
            out.well_formed = False
            continue
        out.chunks += 1
        err = obj.get("error") if isinstance(obj, dict) else None
        if isinstance(err, dict) and err.get("type") == "BadGatewayError":
            out.error_event = True
    out.done = bool(events) and events[-1].strip() == b"data: [DONE]"


async def stream(s: aiohttp.ClientSession, base: str, tokens: int, started: asyncio.Event) -> StreamOutcome:
    out = StreamOutcome()
    body = {"model": MODEL, "prompt": "tell me a long story", "max_tokens": tokens, "stream": True}
    body["ignore_eos"] = True
    async with s.post(f"{base}/v1/completions", json=body) as r:
        out.instance = r.headers.get("x-kvrouter-instance", "")
        first = await r.content.readany()
        started.set()
        rest = await r.read()
    parse_sse(first + rest, out)
    return out


async def crash(res: Resources, cfg: CrashConfig) -> ScenarioResult:
    t_start = time.perf_counter()
    fleet = res.fleet(cfg.instances)
    async with fleet:
        g = await res.gateway(fleet, {"routing": {"policy": "round-robin"}})
        async with g, client(timeout_s=120) as s:
            gw = g.gateway
            victim = fleet.servers[1]
            up = gw.pool.upstreams[victim.name]
            for srv in fleet.servers:
                await set_faults(s, srv.url, slowdown=cfg.slowdown)
            shots: list[tuple[float, Shot]] = []
            stop = asyncio.Event()

            async def background() -> None:
                body = {"model": MODEL, "prompt": "a short question", "max_tokens": 2}
                url = f"{g.base}/v1/completions"
                tasks = []
                while not stop.is_set():
                    shot = Shot(sent=time.monotonic())
                    shots.append((shot.sent, shot))
                    tasks.append(asyncio.create_task(one(s, url, body, shot)))
                    await asyncio.sleep(1 / cfg.background_rate)
                await asyncio.gather(*tasks)

            rotation: list[tuple[float, bool]] = []

            async def watch() -> None:
                last = None
                while True:
                    if up.healthy != last:
                        last = up.healthy
                        rotation.append((time.monotonic(), last))
                    await asyncio.sleep(0.005)

            bg = asyncio.create_task(background())
            watcher = asyncio.create_task(watch())
            starts = [asyncio.Event() for _ in range(cfg.streams)]
            streams = [asyncio.create_task(stream(s, g.base, cfg.stream_tokens, e)) for e in starts]
            try:
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in starts)), 30)
                await asyncio.sleep(0.2)
                t_crash = time.monotonic()
                await set_faults(s, victim.url, crash=True, down_s=cfg.down_s)
                outcomes = await asyncio.wait_for(asyncio.gather(*streams), 120)
                await until(lambda: not victim.instance.faults.crashed, cfg.down_s + 10, "victim back")
                await until(lambda: up.healthy, 10, "victim back in rotation")
                await asyncio.sleep(1.0)  # traffic after its return
            finally:
                stop.set()
                await asyncio.wait_for(bg, 60)
                await cancel_all([watcher, *streams])
            for srv in fleet.servers:
                await set_faults(s, srv.url, slowdown=1.0)
    on_victim = [o for o in outcomes if o.instance == victim.name]
    others = [o for o in outcomes if o.instance != victim.name]
    if not on_victim:
        raise ScenarioError("no stream landed on the victim")
    out_at = next((t for t, healthy in rotation if not healthy and t >= t_crash), None)
    avoid_s = (out_at - t_crash) if out_at is not None else float("inf")
    t_back = next((t for t, healthy in rotation if healthy and out_at is not None and t > out_at), t_crash)
    failed = [sh for _, sh in shots if sh.status != 200 or sh.error]
    served_after = sum(1 for t, sh in shots if t >= t_back and sh.instance == victim.name)
    to_victim_late = sum(
        1
        for t, sh in shots
        if t_crash + cfg.avoid_within_s <= t < t_back - 0.3 and sh.instance == victim.name
    )
    figures: list[Figure] = [
        exactly(
            f"victim's streams ending with a well-formed error event (of {len(on_victim)})",
            sum(o.error_event and o.done and o.well_formed for o in on_victim),
            len(on_victim),
        ),
        exactly(
            f"other streams completed (of {len(others)})",
            sum(o.done and o.well_formed and not o.error_event for o in others),
            len(others),
        ),
        exactly(f"other requests failed (of {len(shots)})", len(failed), 0),
        at_most(
            "victim out of rotation after the crash",
            avoid_s * 1e3,
            cfg.avoid_within_s * 1e3,
            unit="ms",
            fmt="{:.0f}",
        ),
        exactly("requests answered by the victim while down", to_victim_late, 0),
        at_least("requests served by the victim after its return (1 s)", served_after, 1, fmt="{:.0f}"),
        Figure(
            "back in rotation after its restart",
            f"{(t_back - t_crash - cfg.down_s) * 1e3:.0f} ms after it came up",
            "",
            None,
        ),
    ]
    return ScenarioResult(
        "crash", "Faults", "Instance crash mid-stream", figures, time.perf_counter() - t_start
    )
