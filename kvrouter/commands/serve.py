"""``kvrouter serve --fleet FILE [--host 127.0.0.1] [--port 8080] [--policy kv-aware]``: the gateway."""

from __future__ import annotations

import argparse
import asyncio
import logging

from aiohttp import web

from indexer.errors import ConfigError

from ..config import load_router_fleet
from ..gateway import Gateway, build_gateway
from ..pipeline import FleetTokens
from ..routing import ALL_POLICIES
from .heap import freeze_on_startup

log = logging.getLogger("kvrouter.serve")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fleet", required=True, help="fleet file (YAML)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--policy", choices=ALL_POLICIES, default=None, help="override routing.policy")
    p.add_argument(
        "--no-events", action="store_true", help="do not subscribe to KV events (load/prefix only)"
    )


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_router_fleet(args.fleet)
    except ConfigError as e:
        log.error("%s", e)
        return 2
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    gw = Gateway(
        cfg,
        tokens=FleetTokens.from_config(cfg),
        policy=args.policy,
        subscribe=not args.no_events,
        fleet_path=args.fleet,
    )
    app = build_gateway(gw)
    app.on_startup.append(freeze_on_startup)  # after the gateway's start: tokenizers are loaded by then
    log.info(
        "gateway listening",
        extra={
            "host": args.host,
            "port": args.port,
            "policy": gw.router.config.policy,
            "instances": len(cfg.instances),
        },
    )
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None, handler_cancellation=True)
    return 0
