"""Starting a simulated fleet and a gateway in front of it, in-process, on 127.0.0.1."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer

from indexer.config import parse_fleet
from kvrouter.config import RouterFleetConfig
from kvrouter.gateway import Gateway, build_gateway
from kvrouter.lab.sim.server.fleet import SimFleet, SimFleetConfig
from kvrouter.pipeline import FleetTokens
from tests.support.sim_server import shared_sim_tokenizer
from tests.support.tokenizers import SHARED
from tests.support.wait import until

MODEL = "sim-model"


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


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
    cfg = parse_fleet(merge(merge(fleet.fleet_dict(), fast), over), RouterFleetConfig)
    gw = Gateway(cfg, tokens=FleetTokens.from_config(cfg, loader=SHARED))
    app = build_gateway(gw)
    server = TestServer(app, host="127.0.0.1", handler_cancellation=True)
    await server.start_server()
    try:
        if in_rotation:
            await until(
                lambda: all(u.healthy for u in gw.pool.upstreams.values()), what="every instance in rotation"
            )
        yield gw, str(server.make_url("")).rstrip("/")
    finally:
        await server.close()
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


def app_of(gw: Gateway) -> web.Application:  # pragma: no cover - helper for debugging
    return build_gateway(gw)
