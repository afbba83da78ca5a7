"""``kvrouter serve --fleet FILE [--host 127.0.0.1] [--port 8080] [--policy kv-aware] [--workers N]``: the
gateway.  ``--workers`` (default: the machine's cores) worker processes accept on one port and route as one
(``kvrouter.host``); ``--workers 1`` is one process, no fork."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import math
import os
from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp import web

from indexer.errors import ConfigError

from ..allocator import active as active_allocator
from ..config import RouterFleetConfig, load_router_fleet
from ..gateway import Gateway, build_gateway
from ..heap import HeapTrimmer, freeze_on_startup, trim_heap
from ..pipeline import FleetTokens
from ..routing import ALL_POLICIES

log = logging.getLogger("kvrouter.serve")


def default_workers(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """The cores this process may run on: its CPU affinity, capped by its cgroup's CPU quota (a
    container's CPU limit: a pod limited to 2 CPUs on a 64-core node gets 2 workers, not 64)."""
    try:
        cores = max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        cores = max(1, os.cpu_count() or 1)
    quota = cpu_quota(cgroup)
    return cores if quota is None else max(1, min(cores, math.ceil(quota)))


def cpu_quota(cgroup: Path) -> float | None:
    """CPUs the cgroup may use per period (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` /
    ``cpu.cfs_period_us``); None when unlimited or unreadable."""
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((cgroup / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((cgroup / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fleet", required=True, help="fleet file (YAML)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--policy", choices=ALL_POLICIES, default=None, help="override routing.policy")
    p.add_argument(
        "--no-events", action="store_true", help="do not subscribe to KV events (load/prefix only)"
    )
    p.add_argument(
        "--front",
        choices=("lean", "aiohttp"),
        default=None,
        help="override gateway.front: the server in front of the routed routes",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="worker processes on one port, sharing one view of the fleet (default: the machine's cores)",
    )


def _use_uvloop() -> None:
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass


def _serve(
    args: argparse.Namespace,
    cfg: RouterFleetConfig,
    tokens: FleetTokens,
    *,
    host: object | None = None,
    reuse_port: bool = False,
) -> int:
    _use_uvloop()
    if host is not None:
        from ..host.wiring import WorkerHost

        assert isinstance(host, WorkerHost)
    gw = Gateway(
        cfg,
        tokens=tokens,
        policy=args.policy,
        subscribe=not args.no_events,
        fleet_path=args.fleet,
        host=host,
    )
    app = build_gateway(gw)
    app.on_startup.append(freeze_on_startup)  # after the gateway's start: tokenizers are loaded by then
    trimmer = HeapTrimmer(registry=gw.metrics.registry)

    async def heap_trim(_app: web.Application) -> AsyncIterator[None]:
        trimmer.start()
        yield
        await trimmer.stop()

    app.cleanup_ctx.append(heap_trim)
    log.info(
        "gateway listening",
        extra={
            "host": args.host,
            "port": args.port,
            "policy": gw.router.config.policy,
            "instances": len(cfg.instances),
            "worker": getattr(host, "me", None),
            "allocator": active_allocator(),
        },
    )
    if (args.front or cfg.gateway.front) == "lean":
        from ..gateway.lean import run

        run(app, gw, host=args.host, port=args.port, reuse_port=reuse_port)
        return 0
    web.run_app(
        app,
        host=args.host,
        port=args.port,
        print=None,
        access_log=None,
        handler_cancellation=True,
        reuse_port=reuse_port or None,
    )
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_router_fleet(args.fleet)
    except ConfigError as e:
        log.error("%s", e)
        return 2
    n = args.workers if args.workers is not None else default_workers()
    if n < 1:
        log.error("--workers must be at least 1")
        return 2
    tokens = FleetTokens.from_config(cfg)
    from ..host.supervisor import Supervisor, preload, shared_host

    preload(cfg, tokens)
    gc.collect()
    # What is loaded by now (tokenizers, kernels, modules: about 200 k objects) lives as long as the
    # process: frozen, a full collection no longer walks it (0.15 s each, at the whim of allocation, on a
    # request's path) nor writes to its pages, which the workers share copy-on-write.
    gc.freeze()
    if n == 1:
        return _serve(args, cfg, tokens)
    trim_heap()  # what loading freed, given back before the workers share the rest copy-on-write
    mem = shared_host(cfg, n)
    log.info("starting workers", extra={"workers": n, "port": args.port})
    return Supervisor(n, lambda h: _serve(args, cfg, tokens, host=h, reuse_port=True), mem).run()
