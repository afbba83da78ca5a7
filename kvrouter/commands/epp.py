"""``kvrouter epp --fleet FILE [--grpc-port 9002] [--port 9003]``: kvrouter as the Endpoint Picker of a
Gateway API Inference Extension gateway (Envoy's ext_proc), with its operational HTTP routes beside."""

from __future__ import annotations

import argparse
import asyncio
import logging

from aiohttp import web

from indexer.errors import ConfigError
from indexer.kernels import compile_all

from ..config import load_router_fleet
from ..epp import Picker, PickerOptions, build_admin
from ..gateway import Gateway
from ..heap import freeze_on_startup
from ..pipeline import FleetTokens
from ..routing import ALL_POLICIES

log = logging.getLogger("kvrouter.epp")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fleet", required=True, help="fleet file (YAML)")
    p.add_argument("--host", default="127.0.0.1", help="address of both servers (0.0.0.0 in a pod)")
    p.add_argument("--grpc-port", type=int, default=9002, help="ext_proc gRPC port")
    p.add_argument("--port", type=int, default=9003, help="HTTP port: /metrics /health /livez /v1/fleet")
    p.add_argument("--policy", choices=ALL_POLICIES, default=None, help="override routing.policy")
    p.add_argument(
        "--fallbacks",
        type=int,
        default=1,
        help="endpoints named per request, best first (1 for Envoy's ORIGINAL_DST cluster)",
    )
    p.add_argument(
        "--no-events", action="store_true", help="do not subscribe to KV events (load/prefix only)"
    )


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_router_fleet(args.fleet)
        options = PickerOptions(grpc_host=args.host, grpc_port=args.grpc_port, fallbacks=args.fallbacks)
        options.validate()
    except ConfigError as e:
        log.error("%s", e)
        return 2
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    compile_all()  # every indexer kernel before the first event, not inside it (``indexer.kernels``)
    gw = Gateway(
        cfg,
        tokens=FleetTokens.from_config(cfg),
        policy=args.policy,
        subscribe=not args.no_events,
        fleet_path=args.fleet,
    )
    app, _ = build_admin(Picker(gw, options))
    app.on_startup.append(freeze_on_startup)
    log.info(
        "endpoint picker starting",
        extra={"grpc_port": args.grpc_port, "port": args.port, "policy": gw.router.config.policy},
    )
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None, handler_cancellation=True)
    return 0
