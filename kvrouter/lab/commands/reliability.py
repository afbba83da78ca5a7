"""``kvrouter reliability [--quick] [--json OUT] [--markdown OUT] [--only a,b]``: the reliability suite.

Faults, bad input, load and security scenarios (``kvrouter.lab.reliability.suite``) on 127.0.0.1, then one
table of figures on stdout (Markdown, the one in docs/reliability.md).  Progress goes to stderr.  Exit 0
when every figure held, 1 otherwise.  The full run takes several minutes; ``--quick`` a few.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import platform
import sys
import time
from collections.abc import Callable

import msgspec

from indexer.kernels import compile_all
from kvrouter.lab.reliability.figures import render_notes, render_table
from kvrouter.lab.reliability.suite import SCENARIOS, run_suite
from kvrouter.lab.sim.engine.hashing import warmup as sim_warmup


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="small settings (what make test runs)")
    p.add_argument("--json", dest="json_out", default=None, help="also write every figure as JSON here")
    p.add_argument("--markdown", default=None, help="also write the table (and notes) as Markdown here")
    p.add_argument("--only", default=None, help=f"comma-separated scenarios, of: {', '.join(SCENARIOS)}")
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="kvrouter serve --workers for the load scenario's gateway (default: serve's, one per core)",
    )
    p.add_argument(
        "--sustain-s",
        type=float,
        default=None,
        help="length of the load scenario's sustained run at the highest rate held (default: 60 s)",
    )
    p.add_argument(
        "--verbose", action="store_true", help="keep the scenarios' logs (default: errors only, on stderr)"
    )


def run(a: argparse.Namespace) -> int:
    names = None if not a.only else [n.strip() for n in a.only.split(",") if n.strip()]
    unknown = [n for n in names or [] if n not in SCENARIOS]
    if unknown:
        print(f"unknown scenarios: {', '.join(unknown)}; known: {', '.join(SCENARIOS)}", file=sys.stderr)
        return 2
    if a.sustain_s is not None and a.sustain_s <= 0:
        print("--sustain-s must be positive", file=sys.stderr)
        return 2
    if not a.verbose:
        # The fault scenarios make the components log every fault they handle; that is their job, not
        # this report's.  The log-hygiene scenario captures its own records at DEBUG regardless.
        logging.getLogger().setLevel(logging.ERROR)
    factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop
    with contextlib.suppress(ImportError):  # uvloop: the driver's own overhead stays small under load
        import uvloop

        factory = uvloop.new_event_loop
    # Kernels compiled (or loaded from numba's cache) first: on a fresh install the first payload of the
    # event fuzz otherwise compiles them (minutes on a busy machine) and its slowest-payload figure
    # measures the compiler, not the decoder; the simulated fleets' processes load the same cache.
    t_kernels = time.perf_counter()
    compile_all()
    sim_warmup()
    print(f"[reliability] kernels ready in {time.perf_counter() - t_kernels:.1f} s", file=sys.stderr)
    t0 = time.perf_counter()
    with asyncio.Runner(loop_factory=factory) as runner:
        results = runner.run(
            run_suite(names, quick=a.quick, progress=sys.stderr, workers=a.workers, sustain_s=a.sustain_s)
        )
    wall = time.perf_counter() - t0
    head = (
        f"kvrouter reliability{' --quick' if a.quick else ''}: {len(results)} scenarios in {wall:.0f} s "
        f"on {platform.node() or 'this machine'} ({platform.machine()}, Python {platform.python_version()})"
    )
    table = render_table(results)
    notes = render_notes(results)
    print(head)
    print()
    print(table)
    if notes:
        print()
        print(notes)
    if a.markdown:
        with open(a.markdown, "w") as f:
            compact = render_table(results, pad=False)
            f.write(f"{head}\n\n{compact}\n" + (f"\n{notes}\n" if notes else ""))
    if a.json_out:
        with open(a.json_out, "wb") as f:
            f.write(
                msgspec.json.format(
                    msgspec.json.encode({"wall_s": wall, "quick": a.quick, "results": results})
                )
            )
    return 0 if all(r.ok for r in results) else 1
