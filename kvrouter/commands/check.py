"""``kvrouter check --fleet FILE [--json] [--timeout S]``: the fleet file, then every instance, verified
before traffic (``gateway.fleet_check``).  Exit status 0 when nothing failed, 1 when a check failed, 2 when
the file itself is unusable."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys

import aiohttp
from prometheus_client import CollectorRegistry

from indexer import Indexer
from indexer.errors import ConfigError

from ..config import RouterFleetConfig, load_router_fleet
from ..gateway.fleet_check import InstanceReport, as_json, check_fleet, table
from ..pipeline import FleetTokens, PipelineMetrics, RequestPipeline
from ..routing import Router, Target

log = logging.getLogger("kvrouter.check")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fleet", required=True, help="fleet file (YAML)")
    p.add_argument("--json", action="store_true", help="one JSON document instead of the table")
    p.add_argument("--timeout", type=float, default=3.0, help="per call, seconds")


async def _check(cfg: RouterFleetConfig, timeout_s: float) -> list[InstanceReport]:
    router = Router(Indexer(cfg.block_size), cfg.router_config())
    tokens = FleetTokens.from_config(cfg)
    pipeline = RequestPipeline(cfg, router, _NoFleet(), tokens, PipelineMetrics(CollectorRegistry()))
    try:
        async with aiohttp.ClientSession() as session:
            return await check_fleet(cfg, pipeline, session, timeout_s=timeout_s)
    finally:
        tokens.close()


class _NoFleet:
    """``check`` routes nothing: the pipeline only lends its tokenizer and parity state."""

    def targets(self, model: str | None) -> list[Target]:
        return []

    def known_model(self, model: str | None) -> bool:
        return True

    def base_model(self, model: str | None) -> str | None:
        return None

    def instance_targets(self, name: str) -> list[Target] | None:
        return None


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_router_fleet(args.fleet)
    except ConfigError as e:
        if args.json:
            print(json.dumps({"ok": False, "fleet_file": str(e)}))
        else:
            print(f"fleet file: {e}", file=sys.stderr)
        return 2
    reports = asyncio.run(_check(cfg, args.timeout))
    if args.json:
        print(json.dumps(as_json(reports), indent=2))
    else:
        print(table(reports))
    return 1 if any(r.failed for r in reports) else 0
