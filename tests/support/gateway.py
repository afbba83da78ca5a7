"""Starting a simulated fleet and a gateway in front of it, in-process, on 127.0.0.1."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from indexer.config import parse_fleet
from kvrouter.config import RouterFleetConfig
from kvrouter.gateway import Gateway, build_gateway
from kvrouter.gateway.lean import LeanSite
from kvrouter.lab.sim.server.fleet import SimFleet, SimFleetConfig
from kvrouter.pipeline import FleetTokens
from tests.support.sim_server import shared_sim_tokenizer
from tests.support.tokenizers import SHARED
from tests.support.wait import until

MODEL = "sim-model"

TEST_FRONT = os.environ.get("KVROUTER_TEST_FRONT")
"""When set (``aiohttp`` or ``lean``): every gateway a test starts has this front door, whatever its fleet
file says, so the whole suite runs against either."""


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def counter_by(text: str, family: str, label: str, **where: str) -> dict[str, float]:
    """A counter family's ``_total`` samples in a Prometheus exposition, by the value of ``label`` (only the
    samples whose labels include ``where``)."""
    return {
        x.labels[label]: x.value
        for fam in text_string_to_metric_families(text)
        if fam.name == family
        for x in fam.samples
        if x.name.endswith("_total") and all(x.labels.get(k) == v for k, v in where.items())
    }


def with_front(fleet: dict[str, Any]) -> dict[str, Any]:
    """``fleet`` with ``gateway.front`` set to ``TEST_FRONT`` (unchanged when it is not set)."""
    return merge(fleet, {"gateway": {"front": TEST_FRONT}}) if TEST_FRONT else fleet


@asynccontextmanager
async def serving(gw: Gateway, app: web.Application) -> AsyncIterator[str]:
    """``app`` served on 127.0.0.1 (a free port) by the gateway's front door, as ``kvrouter serve`` does;
    yields the base URL."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site: LeanSite | web.TCPSite = (
        LeanSite(runner, gw, "127.0.0.1", 0)
        if gw.cfg.gateway.front == "lean"
        else web.TCPSite(runner, "127.0.0.1", 0)
    )
    try:
        await site.start()
        yield f"http://127.0.0.1:{site.port}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def gateway(
    fleet: SimFleet, *, in_rotation: bool = True, **over: Any
) -> AsyncIterator[tuple[Gateway, str]]:
    """A gateway for the fleet (fleet file + ``over``), serving at the yielded base URL once every instance
    is in rotation (``in_rotation=False``: at once, for tests that start with an instance down)."""
    # no admission on the event loop's delay: this loop runs the fleet and the test too, not a gateway alone
    fast = {
        "gateway": {"health_interval_s": 0.2, "metrics_interval_s": 0.2},
        "limits": {"max_loop_lag_s": 0.0},
    }
    cfg = parse_fleet(merge(with_front(merge(fleet.fleet_dict(), fast)), over), RouterFleetConfig)
    gw = Gateway(cfg, tokens=FleetTokens.from_config(cfg, loader=SHARED))
    try:
        async with serving(gw, build_gateway(gw)) as base:
            if in_rotation:
                await until(
                    lambda: all(u.healthy for u in gw.pool.upstreams.values()),
                    what="every instance in rotation",
                )
            yield gw, base
    finally:
        tokens = gw.tokens
        if isinstance(tokens, FleetTokens):
            tokens.close()


def sim_fleet(n: int = 3, **kw: Any) -> SimFleet:
    """A simulated fleet of the test profile; on the default tokenizer, the test process's shared one."""
    cfg = SimFleetConfig(instances=n, profile="test", capacity_blocks=kw.pop("capacity_blocks", 2048), **kw)
    if cfg.tokenizer is None and cfg.chat_template is None:
        tok, template = shared_sim_tokenizer()
        return SimFleet(cfg, tokenizer=tok, chat_template=template)
    return SimFleet(cfg)


HEALTHY = {
    "dead": False,
    "latency_s": 0.0,
    "slowdown": 1.0,
    "stall_s": 0.0,
    "stall_events": False,
    "mute_replay": False,
    "render_fault": False,
    "drop_rate": 0.0,
}
"""Every fault knob of ``POST /sim/faults`` off."""


async def heal(fleet: SimFleet) -> None:
    """Every instance of a fleet shared by several tests without a fault: a test that sets one and fails
    before it unsets it cannot degrade the next test."""
    async with aiohttp.ClientSession() as s:
        for srv in fleet.servers:
            await until(lambda srv=srv: not srv.instance.faults.crashed, what=f"{srv.name} back up")
            async with s.post(f"{srv.url}/sim/faults", json=HEALTHY) as r:
                assert r.status == 200, await r.text()


def app_of(gw: Gateway) -> web.Application:  # pragma: no cover - helper for debugging
    return build_gateway(gw)
