"""In-process stacks for the fault scenarios: a simulated fleet and gateways in front of it, on 127.0.0.1.

::

    SimFleet (N instances: HTTP + PUB + replay ROUTER each) ◀── GatewayProc (its front door, real port)
         ▲ engines' caches are the ground truth                    │ its Indexer, Router, UpstreamPool
         └───────────────── fault knobs: POST /sim/faults ◀────────┴── scenario (aiohttp client)

Everything shares one event loop, so scenarios can read the engines' true caches and the gateway's index
directly while real sockets carry the traffic.  Load figures come from ``procs`` (separate processes)
instead: one loop would measure itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
from aiohttp import web

from indexer.config import parse_fleet
from kvrouter.api.usage import read_usage
from kvrouter.config import RouterFleetConfig
from kvrouter.gateway import Gateway, build_gateway
from kvrouter.gateway.lean import LeanSite
from kvrouter.lab.sim.server.faults import FaultConfig
from kvrouter.lab.sim.server.fleet import SimFleet, SimFleetConfig, free_port_block
from kvrouter.lab.sim.server.tokenizer import load_sim_tokenizer
from kvrouter.pipeline import FleetTokens
from tokenizer_cache import CachedTokenizer, default_tokenizer_path

MODEL = "sim-model"
FAST = {
    "gateway": {"health_interval_s": 0.2, "metrics_interval_s": 0.2},
    "limits": {"max_loop_lag_s": 0.0},
}
"""Gateway settings of every scenario: health checks often enough to measure seconds-scale recovery; no
admission on the event loop's delay (the loop here is the whole stack's and the driver's, not a
gateway's: the load scenario, with the gateway in a process of its own, measures that admission)."""


class ScenarioError(Exception):
    """A scenario could not set itself up (a port, a process, a condition that never came)."""


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Deep merge of fleet-file dicts (``over`` wins)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def free_port() -> int:
    """A free port below 32768 (a reconnecting ZeroMQ socket can self-connect in the ephemeral range)."""
    return free_port_block(1)


class Resources:
    """What every in-process scenario shares: the tokenizer, loaded once (it takes seconds), both the
    simulated instances' and the gateways' (a warmed ``FleetTokens``, never closed by a gateway)."""

    def __init__(self, workers: int | None = None, sustain_s: float | None = None) -> None:
        self.workers = workers
        """``kvrouter serve --workers`` of the scenarios that run the gateway as a process (None: serve's
        default, one worker per core)."""
        self.sustain_s = sustain_s
        """The load scenario's sustained run at R, in seconds (None: its own default)."""
        self._tok: CachedTokenizer | None = None
        self._template: str | None = None
        self._tokens: FleetTokens | None = None

    async def open(self) -> None:
        if self._tok is None:
            loop = asyncio.get_running_loop()
            self._tok, self._template = await loop.run_in_executor(
                None, load_sim_tokenizer, default_tokenizer_path(), None
            )

    def close(self) -> None:
        if self._tokens is not None:
            self._tokens.close()
            self._tokens = None
        if self._tok is not None:
            self._tok.close()
            self._tok = None

    async def __aenter__(self) -> Resources:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def fleet(self, instances: int = 3, *, capacity_blocks: int = 2048, **kw: Any) -> SimFleet:
        """A fleet of the fast ``test`` profile (1 ms decode steps), sharing the tokenizer."""
        if self._tok is None:
            raise ScenarioError("Resources not opened")
        faults = kw.pop("faults", FaultConfig())
        fleet = SimFleet(
            SimFleetConfig(
                instances=instances, profile="test", capacity_blocks=capacity_blocks, faults=faults, **kw
            ),
            tokenizer=self._tok,
        )
        fleet.chat_template = self._template  # what the fleet would have found loading it itself
        return fleet

    async def tokens(self, cfg: RouterFleetConfig) -> FleetTokens:
        if self._tokens is None:
            self._tokens = FleetTokens.from_config(cfg)
            await self._tokens.warm([None, MODEL])
        return self._tokens

    async def gateway(self, fleet: SimFleet, over: dict[str, Any] | None = None, **kw: Any) -> GatewayProc:
        """A gateway for ``fleet`` with ``over`` merged into its fleet file (not started)."""
        cfg = parse_fleet(merge(merge(fleet.fleet_dict(), FAST), over or {}), RouterFleetConfig)
        return GatewayProc(cfg, tokens=await self.tokens(cfg), **kw)


class GatewayProc:
    """One gateway served on a real port, in this loop.  ``start``/``stop`` may repeat (a restart)."""

    def __init__(
        self,
        cfg: RouterFleetConfig,
        *,
        tokens: FleetTokens | None = None,
        port: int | None = None,
        policy: str | None = None,
    ) -> None:
        self.cfg = cfg
        self.port = port or free_port()
        self.policy = policy
        self.gw: Gateway | None = None
        self._runner: web.AppRunner | None = None
        self._shared_tokens = tokens
        self._tokens: FleetTokens | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def gateway(self) -> Gateway:
        if self.gw is None:
            raise ScenarioError("the gateway is not running")
        return self.gw

    def build(self) -> Gateway:
        """A fresh gateway (not yet serving): a caller may restore a snapshot into it before ``serve``."""
        tokens = self._shared_tokens
        if tokens is None:
            tokens = self._tokens = FleetTokens.from_config(self.cfg)
        self.gw = Gateway(self.cfg, tokens=tokens, policy=self.policy)
        return self.gw

    async def serve(self) -> None:
        gw = self.gw or self.build()
        runner = web.AppRunner(build_gateway(gw), handler_cancellation=True, access_log=None)
        await runner.setup()
        site: LeanSite | web.TCPSite = (
            LeanSite(runner, gw, "127.0.0.1", self.port)
            if gw.cfg.gateway.front == "lean"
            else web.TCPSite(runner, "127.0.0.1", self.port)
        )
        deadline = time.monotonic() + 5
        while True:
            try:
                await site.start()
                break
            except OSError:  # the previous run's port may linger a moment after a restart
                if time.monotonic() > deadline:
                    await runner.cleanup()
                    raise
                await asyncio.sleep(0.05)
        self._runner = runner

    async def start(self) -> None:
        self.build()
        await self.serve()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._tokens is not None:
            self._tokens.close()
            self._tokens = None
        self.gw = None

    async def __aenter__(self) -> GatewayProc:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


@asynccontextmanager
async def client(timeout_s: float = 30.0, limit: int = 0) -> AsyncIterator[aiohttp.ClientSession]:
    conn = aiohttp.TCPConnector(limit=limit)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
        yield s


async def set_faults(session: aiohttp.ClientSession, url: str, **faults: Any) -> None:
    """``POST /sim/faults``; a crash may cut this very connection before it answers."""
    try:
        async with session.post(f"{url}/sim/faults", json=faults) as r:
            await r.read()
            if r.status != 200 and not faults.get("crash"):
                raise ScenarioError(f"fault update {faults} refused: {r.status}")
    except aiohttp.ClientError:
        if not faults.get("crash"):
            raise


def subscribed(g: GatewayProc) -> bool:
    """Whether the gateway's subscriber is connected to every event source."""
    sub = g.gateway.subscriber
    if sub is None:
        raise ScenarioError("the gateway does not subscribe to events")
    return all(st.connected for st in sub.status.values())


async def until(cond: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> float:
    """Wait for ``cond``; returns the seconds it took.  Raises ``ScenarioError`` on timeout."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise ScenarioError(f"{what} not reached in {timeout} s")
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


async def completion(
    session: aiohttp.ClientSession,
    base: str,
    prompt: str | list[int],
    *,
    max_tokens: int = 4,
    headers: dict[str, str] | None = None,
    **extra: Any,
) -> tuple[int, dict[str, str], dict[str, Any]]:
    """One non-streamed completion: status, headers, JSON body (``{}`` if not JSON)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, **extra}
    async with session.post(f"{base}/v1/completions", json=body, headers=headers) as r:
        try:
            data = await r.json(content_type=None)
        except ValueError:
            data = {}
        return r.status, dict(r.headers), data if isinstance(data, dict) else {}


def cached_tokens(answer: object) -> int:
    """``usage.prompt_tokens_details.cached_tokens`` of an answer (0 when absent)."""
    u = read_usage(answer)
    return (u.cached_tokens or 0) if u is not None else 0


async def cancel_all(tasks: list[asyncio.Task[Any]]) -> None:
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await t
