"""``kvrouter indexer --fleet FILE``: the standalone indexer service."""

from __future__ import annotations

import argparse
import logging

from aiohttp import web

from indexer.config import load_fleet
from indexer.errors import ConfigError
from indexer.kernels import compile_all
from indexer.service import build

from ..heap import freeze_startup_heap

log = logging.getLogger("kvrouter.indexer")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fleet", required=True, help="fleet file (YAML)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8081)


def run(args: argparse.Namespace) -> int:
    try:
        fleet = load_fleet(args.fleet)
    except ConfigError as e:
        log.error("%s", e)
        return 2
    from ..config import load_router_fleet
    from ..pipeline import FleetTokens

    rcfg = load_router_fleet(args.fleet)
    tokens = FleetTokens.from_config(rcfg)
    compile_all()  # every kernel before the first event, not inside it (``indexer.kernels``)
    app = build(fleet, encoder=tokens)

    async def load_tokenizers_then_freeze(_app: web.Application) -> None:
        # Loaded now rather than on the first request that needs them, so the freeze covers them.
        await tokens.warm(rcfg.served_models())
        freeze_startup_heap()

    app.on_startup.append(load_tokenizers_then_freeze)
    log.info(
        "indexer listening", extra={"host": args.host, "port": args.port, "instances": len(fleet.instances)}
    )
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)
    return 0
