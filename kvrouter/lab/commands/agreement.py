"""``kvrouter agreement``: does the simulation agree with the live path on cache hit rate?

A small workload runs through a simulated fleet + the gateway over real HTTP and ZeroMQ, then through
``kvrouter eval``'s virtual fleet with the same parameters; exit status 0 when the hit rates agree within
``--tolerance`` (default 2 points), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

import msgspec

from kvrouter.lab.agreement import DEFAULT_OVERRIDES, AgreementConfig, check, report
from kvrouter.lab.commands.eval import parse_sets


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = AgreementConfig()
    p.add_argument("--workload", default=d.workload, help="a registered workload, chat or text form")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help=f"workload parameter (defaults: {json.dumps(dict(DEFAULT_OVERRIDES))})",
    )
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="closed-loop clients")
    p.add_argument("--instances", type=int, default=d.instances)
    p.add_argument("--profile", default=d.profile)
    p.add_argument("--speed", type=float, default=d.speed, help="live fleet speed-up over the profile")
    p.add_argument("--capacity-blocks", type=int, default=None, help="KV blocks per instance")
    p.add_argument("--policy", default=d.policy)
    p.add_argument("--tolerance", type=float, default=d.tolerance, help="largest |live - sim| hit rate")
    p.add_argument(
        "--workers",
        type=int,
        default=d.workers,
        help="0: the gateway in this process; N: kvrouter serve --workers N, a fresh connection per request",
    )
    p.add_argument("--json", dest="json_out", default=None, help="also write the result as JSON here")


def config_from_args(a: argparse.Namespace) -> AgreementConfig:
    overrides = dict(DEFAULT_OVERRIDES) if a.workload == AgreementConfig().workload else {"form": "chat"}
    overrides.update(parse_sets(a.set))
    return AgreementConfig(
        workload=a.workload,
        overrides=overrides,
        concurrency=a.concurrency,
        instances=a.instances,
        profile=a.profile,
        speed=a.speed,
        capacity_blocks=a.capacity_blocks,
        policy=a.policy,
        tolerance=a.tolerance,
        workers=a.workers,
    )


def run(a: argparse.Namespace) -> int:
    # The in-process fleet and gateway would log every request; the figures are what this command prints.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    try:
        res = check(config_from_args(a))
    except (ValueError, OSError, TimeoutError) as e:
        print(f"kvrouter agreement: {e}", file=sys.stderr)
        return 2
    print(report(res))
    if a.json_out:
        with open(a.json_out, "wb") as f:
            f.write(msgspec.json.format(msgspec.json.encode(res), indent=1))
    return 0 if res.within_tolerance else 1
