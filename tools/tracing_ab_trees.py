"""Tracing's CPU per request in two source trees at once: each tree's router (its own venv), both traced
(``parentbased_always_off``, spans to an OTLP receiver here), phases interleaved as in ``kvrouter bench
gateway --tracing-ab`` (whose ``_phase`` this uses: 8 concurrent chat requests, the router's whole
process tree counted), so a change is measured against its base under the same load.

    nice -n 5 .venv/bin/python tools/tracing_ab_trees.py --rounds 12 --requests 600 \\
        /work/main /work/wt/BRANCH

Runs without peerbench's venvs (the fake workers run on this interpreter; ``PEERBENCH_DIR`` or
../shared/peerbench holds them).  JSON on stdout: medians over rounds of each tree's CPU per request
without traceparent and with a sampled one, their paired differences, and the exporter process's part.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from kvrouter.lab.bench.common import peerbench_dir
from kvrouter.lab.bench.otlp_sink import OtlpSink
from kvrouter.lab.bench.tracing_ab import _free_port, _phase, _ready
from tokenizer_cache import default_tokenizer_path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trees", nargs=2, help="two source trees, each with its .venv")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--requests", type=int, default=600, help="requests per phase")
    a = ap.parse_args()
    pb = peerbench_dir()
    if pb is None:
        sys.exit("peerbench's fakeworker.py not found (PEERBENCH_DIR)")
    names = [Path(t).name for t in a.trees]
    ports = [_free_port() for _ in range(4)]
    tmp = Path(tempfile.mkdtemp(prefix="kvrouter-tracing-trees-"))
    fleet = tmp / "fleet.yaml"
    lines = ["block_size: 16", f"tokenizer: {default_tokenizer_path()}", "instances:"]
    lines += [f"  - name: w{i}\n    url: http://127.0.0.1:{p}" for i, p in enumerate(ports)]
    fleet.write_text("\n".join(lines) + "\n")
    sink = OtlpSink()
    env = {
        **os.environ,
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_TRACES_SAMPLER": "parentbased_always_off",
        "OTEL_EXPORTER_OTLP_ENDPOINT": sink.start(),
    }
    with open(tmp / "log.txt", "wb") as log:
        fake = [sys.executable, str(pb / "fakeworker.py"), "--ports", *map(str, ports)]
        procs = [subprocess.Popen(fake, stdout=log, stderr=log)]
        routers = {}
        for name, tree in zip(names, a.trees, strict=True):
            port = _free_port()
            cmd = [f"{tree}/.venv/bin/python", "-m", "kvrouter.cli", "--log-level", "WARNING", "serve"]
            cmd += ["--fleet", str(fleet), "--port", str(port), "--workers", "1"]
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=log, env=env, cwd=tree))
            routers[name] = (f"http://127.0.0.1:{port}", procs[-1].pid)

        async def drive() -> tuple[dict[str, list[float]], dict[str, list[float]]]:
            for base, _ in routers.values():
                await _ready(base + "/livez")
            rng = random.Random(7)
            system = " ".join(f"word{rng.randint(0, 5000)}" for _ in range(300))
            order = [(t, m) for t in names for m in ("none", "sampled")]
            got: dict[str, list[float]] = {f"{t}/{m}": [] for t, m in order}
            below: dict[str, list[float]] = {k: [] for k in got}
            for k in range(a.rounds):
                for t, m in order[k % 4 :] + order[: k % 4]:  # each phase first in turn
                    base, pid = routers[t]
                    total, sub = await _phase(base, pid, a.requests, m, rng, system)
                    got[f"{t}/{m}"].append(total / 1e3)
                    below[f"{t}/{m}"].append(sub / 1e3)
            return got, below

        try:
            got, below = asyncio.run(drive())
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(20)
            sink.stop()

    def med(xs: list[float]) -> float:
        return round(statistics.median(xs), 1)

    def paired(x: str, y: str, src: dict[str, list[float]] = got) -> float:
        return med([p - q for p, q in zip(src[x], src[y], strict=True)])

    a_, b_ = names
    print(
        json.dumps(
            {
                "rounds": a.rounds,
                "requests_per_phase": a.requests,
                "median_cpu_us_per_req": {k: med(v) for k, v in got.items()},
                "median_exporter_process_us_per_req": {k: med(v) for k, v in below.items()},
                "sampled_minus_none_paired": {t: paired(f"{t}/sampled", f"{t}/none") for t in names},
                f"{b_}_minus_{a_}_sampled_paired": paired(f"{b_}/sampled", f"{a_}/sampled"),
                f"{b_}_minus_{a_}_none_paired": paired(f"{b_}/none", f"{a_}/none"),
                "spans_received": sink.spans,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
