"""``kvrouter bench [indexer|tokenizer|routing|gateway|redis|replicas|store|epp|parity|workers|all]
[its options]``: one JSON document out.

Each benchmark is a module of ``kvrouter.lab.bench`` with ``add_args(parser)`` and ``main(args) -> dict``;
peers (Dynamo's RadixTree, sglang-router) are measured in the same run when ``shared/peerbench`` and its
venvs are present.  Quote medians and ratios from one run: these machines are noisy.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from typing import Any

BENCHES = {
    "indexer": "kvrouter.lab.bench.indexer_bench",
    "tokenizer": "kvrouter.lab.bench.tokenizer_bench",
    "routing": "kvrouter.lab.bench.routing_bench",
    "gateway": "kvrouter.lab.bench.gateway_bench",
    "redis": "kvrouter.lab.bench.redis_bench",
    "replicas": "kvrouter.lab.bench.replicas_bench",
    "store": "kvrouter.lab.bench.store_bench",
    "epp": "kvrouter.lab.bench.epp_bench",
    "parity": "kvrouter.lab.bench.parity_bench",
    "workers": "kvrouter.lab.bench.workers_bench",
}
ALL = ("indexer", "tokenizer", "routing", "gateway")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("which", nargs="?", default="all", choices=[*BENCHES, "all"])
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument(
        "options",
        nargs=argparse.REMAINDER,
        help="options of the one benchmark named (e.g. kvrouter bench replicas --runs 3); --help lists them",
    )


def _run(name: str, options: list[str] | None = None) -> dict[str, Any]:
    mod = importlib.import_module(BENCHES[name])
    ap = argparse.ArgumentParser(
        prog=f"kvrouter bench {name}",
        allow_abbrev=False,
        description=mod.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    mod.add_args(ap)
    args = ap.parse_args(options or [])  # exits with a usage message on a bad option, before any work
    t0 = time.perf_counter()
    try:
        res: dict[str, Any] = mod.main(args)
    except Exception as e:  # a benchmark that cannot run says why; the others still report
        res = {"error": repr(e)}
    res["bench_wall_s"] = round(time.perf_counter() - t0, 1)
    return res


def run(a: argparse.Namespace) -> int:
    names = ALL if a.which == "all" else (a.which,)
    options = list(getattr(a, "options", None) or [])
    if options and a.which == "all":
        raise SystemExit("options are for one benchmark: kvrouter bench indexer --instances ...")
    out = {name: _run(name, options) for name in names}
    text = json.dumps(out, indent=1, default=str)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    return 0 if all("error" not in r for r in out.values()) else 1


if __name__ == "__main__":
    sys.exit(run(argparse.Namespace(which="all", out=None, options=[])))
