"""The gateway against sglang-router in front of the same fake workers, in the same run.

Both runs use ``shared/peerbench/router_bench.py`` (sequential added latency, added time to the first
streamed chunk, requests/s at concurrency 32, prefix stickiness), so the two sets of figures come from one
harness and one machine state.  kvrouter runs as ``kvrouter serve`` (subprocess) with the fleet file the
harness writes, the kv-aware policy and the fleet's tokenizer (the deepseek tokenizer), i.e. it tokenizes
and hashes every prompt, as in production.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from tokenizer_cache import default_tokenizer_path

from .common import peer_python, peerbench_dir, run_peer


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--seq-n", type=int, default=600)
    ap.add_argument("--thr-n", type=int, default=1000)
    ap.add_argument("--thr-reps", type=int, default=2)
    ap.add_argument("--no-peer", action="store_true", help="skip sglang-router")


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b in (None, 0) else round(a / b, 3)


def main(a: argparse.Namespace) -> dict[str, Any]:
    d, py = peerbench_dir(), peer_python("bench")
    if d is None or py is None:
        return {
            "skipped": "shared/peerbench or its venvs ($PEER_VENVS, see shared/peerbench/setup.sh) missing"
        }
    common = ["--seq-n", str(a.seq_n), "--thr-n", str(a.thr_n), "--thr-reps", str(a.thr_reps)]
    env_tok = {"PEERBENCH_TOKENIZER": default_tokenizer_path()}
    os.environ.update(env_tok)
    kv_cmd = f"{sys.executable} -m kvrouter.cli --log-level WARNING serve --fleet {{fleet}} --port {{port}}"
    out: dict[str, Any] = {}
    ours = run_peer(
        [str(py), str(Path(d) / "router_bench.py"), "--router", "custom", "--router-cmd", kv_cmd, *common]
    )
    out["kvrouter"] = ours
    if not a.no_peer:
        out["sglang"] = run_peer(
            [
                str(py),
                str(Path(d) / "router_bench.py"),
                "--router",
                "sglang",
                "--policy",
                "cache_aware",
                *common,
            ]
        )
    if ours and out.get("sglang"):
        k, s = ours, out["sglang"]

        def g(r: dict[str, Any], *path: str) -> float | None:
            v: Any = r
            for p in path:
                v = v.get(p) if isinstance(v, dict) else None
            return v if isinstance(v, int | float) else None

        out["ratios_kvrouter_over_sglang"] = {
            "added_p50_small": _ratio(
                g(k, "sequential", "added_small", "p50_ms"), g(s, "sequential", "added_small", "p50_ms")
            ),
            "added_p50_big": _ratio(
                g(k, "sequential", "added_big", "p50_ms"), g(s, "sequential", "added_big", "p50_ms")
            ),
            "rps_small": _ratio(
                g(k, "throughput", "router_small", "rps"), g(s, "throughput", "router_small", "rps")
            ),
            "rps_big": _ratio(
                g(k, "throughput", "router_big", "rps"), g(s, "throughput", "router_big", "rps")
            ),
        }
        out["added_first_chunk_ms"] = {
            "kvrouter": _ttfb_added(k),
            "sglang": _ttfb_added(s),
        }
    return out


def _ttfb_added(r: dict[str, Any]) -> float | None:
    seq = r.get("sequential", {})
    rt, dt = seq.get("router_chat_stream_ttfb"), seq.get("direct_chat_stream_ttfb")
    if not rt or not dt:
        return None
    return round(rt["p50_ms"] - dt["p50_ms"], 3)
