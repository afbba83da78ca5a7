"""What grows in a gateway under steady load: Python's heap (tracemalloc, by allocation site) against the
process's resident memory, with and without the heap trimmer (``kvrouter.heap.HeapTrimmer``).

    .venv/bin/python tools/heap_growth.py [--rate 150] [--seconds 90] [--no-trim]

One ``kvrouter serve --workers 1`` (tracemalloc on from its start, 1 frame per site) in front of
``kvrouter sim`` (4 instances, test profile), driven at ``--rate`` completions per second (the load
scenario's prompt mix) for a warm-up third, then the rest.  SIGUSR1 makes the gateway write a snapshot; the
two snapshots are compared by allocation site.  JSON on stdout: RSS (anonymous) and PSS at both marks,
the traced Python heap at both marks, the ten sites that grew most, and the gateway's heap-trim counters.
If RSS grows while the traced heap does not, what grows is outside Python's objects: the C allocator's
free memory that it keeps (fragmentation), not a structure without a bound.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from kvrouter.gateway.upstream_http import UpstreamHttp
from kvrouter.lab.reliability.driver import PromptMix, open_loop, summary
from kvrouter.lab.reliability.procs import Proc, SimProcess, metric, tree_pss_mb, wait_http
from kvrouter.lab.reliability.stack import free_port, merge

# Run as the gateway (``--as-gateway DIR [--no-trim] -- serve args``): tracemalloc on, a snapshot per SIGUSR1.
_CHILD = """
import signal, sys, tracemalloc
from pathlib import Path
out, trim, argv = Path(sys.argv[1]), sys.argv[2] == "trim", sys.argv[3:]
tracemalloc.start(1)
n = [0]
def dump(*_):
    n[0] += 1
    tracemalloc.take_snapshot().dump(str(out / f"snap{n[0]}.bin"))
signal.signal(signal.SIGUSR1, dump)
if not trim:
    import kvrouter.heap
    kvrouter.heap.HeapTrimmer.start = lambda self: None
from kvrouter.cli import main
sys.argv = ["kvrouter", *argv]
sys.exit(main())
"""


def rss_anon_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def _mark(pid: int, out: Path, n: int) -> dict[str, float]:
    os.kill(pid, signal.SIGUSR1)
    path = out / f"snap{n}.bin"
    for _ in range(600):
        if path.exists() and path.stat().st_size > 0:
            await asyncio.sleep(0.5)  # written in full
            break
        await asyncio.sleep(0.1)
    return {"rss_anon_mb": round(rss_anon_mb(pid), 1), "pss_mb": round(tree_pss_mb(pid), 1)}


async def run(a: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="kvrouter-heap-growth-"))
    log = (work / "processes.log").open("wb")
    sim = SimProcess(work, log, "--instances", "4", "--profile", "test", "--answer-tokens", "0")
    gw: Proc | None = None
    try:
        fleet = await sim.start()
        port = free_port()
        cfg = work / "gateway.yaml"
        cfg.write_text(yaml.safe_dump(merge(fleet, {"limits": {"max_requests": 0}}), sort_keys=False))
        serve = ["--log-level", "WARNING", "serve", "--fleet", str(cfg), "--port", str(port)]
        serve += ["--workers", "1"]
        gw = Proc([sys.executable, "-c", _CHILD, str(work), "no" if a.no_trim else "trim", *serve], log)
        gw.start()
        base = f"http://127.0.0.1:{port}"
        await wait_http(base + "/livez", proc=gw)
        assert gw.proc is not None
        pid = gw.proc.pid
        mix = PromptMix(0)
        url = [f"{base}/v1/completions"]
        lean = UpstreamHttp(max_idle_per_host=4000)  # the load scenario's driver client
        async with aiohttp.ClientSession() as s:
            warm = a.seconds / 3
            await open_loop(lean, url, a.rate, warm, mix.body)
            first = await _mark(pid, work, 1)
            t0 = time.monotonic()
            shots = await open_loop(lean, url, a.rate, a.seconds - warm, mix.body)
            lean.close()
            minutes = (time.monotonic() - t0) / 60
            second = await _mark(pid, work, 2)
            trims = await metric(s, base, "kvrouter_heap_trims_total")
            free = await metric(s, base, "kvrouter_heap_free_bytes")
    finally:
        if gw is not None:
            gw.stop()
        sim.stop()
        log.close()
    s1 = tracemalloc.Snapshot.load(str(work / "snap1.bin"))
    s2 = tracemalloc.Snapshot.load(str(work / "snap2.bin"))
    traced = [sum(st.size for st in s.statistics("filename")) / 2**20 for s in (s1, s2)]
    top = s2.compare_to(s1, "lineno")[:10]
    st = summary(shots, a.seconds - warm)
    return {
        "rate": a.rate,
        "trimmer": not a.no_trim,
        "measured_min": round(minutes, 2),
        "requests": {"sent": st["sent"], "ok": st["ok"], "errors": st["errors"], "r429": st["r429"]},
        "rss_anon_mb": [first["rss_anon_mb"], second["rss_anon_mb"]],
        "pss_mb": [first["pss_mb"], second["pss_mb"]],
        "rss_anon_mb_per_min": round((second["rss_anon_mb"] - first["rss_anon_mb"]) / minutes, 2),
        "traced_python_mb": [round(t, 1) for t in traced],
        "traced_mb_per_min": round((traced[1] - traced[0]) / minutes, 2),
        "top_growth_kb": [
            {"site": str(d.traceback[0]), "kb": round(d.size_diff / 1024, 1), "count": d.count_diff}
            for d in top
        ],
        "heap_trims": trims,
        "heap_free_mb_last_look": round(free / 2**20, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=150.0)
    ap.add_argument("--seconds", type=float, default=90.0)
    ap.add_argument("--no-trim", action="store_true", help="the gateway without its heap trimmer")
    print(json.dumps(asyncio.run(run(ap.parse_args())), indent=1))


if __name__ == "__main__":
    main()
