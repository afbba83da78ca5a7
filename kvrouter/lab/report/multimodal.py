"""Notebook 6: kv-aware, prefix-hash and round-robin on the multimodal agent workload.

Eight modelled Qwen2.5-VL-72B instances (8 x H100 each, ``qwen2.5-vl-72b-8xh100``: a miss on an image pays
its vision encoder as well as the prefill of its placeholder tokens) serve computer-use agent sessions
that resend every screenshot at each turn, and questions on documents whose figures every asker shares
(``workloads.multimodal``).  The router keys image blocks by the items' identifiers exactly as vLLM's
events do, so kv-aware sees a screenshot resent by the next turn as cached.  Two loads: the workload's
own arrival rates and twice them.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvrouter.lab.evaluation.compare import EvalSpec
from kvrouter.lab.evaluation.virtual_fleet import FleetSimConfig
from kvrouter.lab.report.grid import Case, Result
from kvrouter.lab.report.scale import Scale
from kvrouter.lab.report.tables import Table
from kvrouter.lab.workloads.multimodal import MultimodalAgentParams
from kvrouter.routing import KV_AWARE, PREFIX_HASH, ROUND_ROBIN

WORKLOAD = "multimodal-agent"
PROFILE = "qwen2.5-vl-72b-8xh100"
POLICIES = (KV_AWARE, PREFIX_HASH, ROUND_ROBIN)
LOADS = (1.0, 2.0)
"""Arrival-rate multipliers of both the sessions and the questions."""


def _overrides(load: float) -> dict[str, object]:
    d = MultimodalAgentParams()
    rates = {"session_arrival": d.session_arrival, "question_arrival": d.question_arrival}
    return {k: {"type": "poisson", "rate": getattr(a, "rate", 1.0) * load} for k, a in rates.items()}


def study_cases(scale: Scale) -> list[Case]:
    """One case per load, each running the three policies (and the pooled-cache bound)."""
    out = []
    for load in scale.values(LOADS):
        spec = EvalSpec(
            workload=WORKLOAD,
            overrides=_overrides(load),
            fleet=FleetSimConfig(instances=8, profile=PROFILE),
            policies=POLICIES,
            series=True,
        )
        out.append(Case(f"x{load:g}", scale.size(spec), load))
    return out


def multimodal_table(results: Sequence[Result]) -> Table:
    """Per load and policy: hit rate, TTFT, the encoder's work per request and GPU time per request."""
    rows = []
    for r in results:
        for name, p in r["policies"].items():
            done = max(1, p["completed"])
            rows.append(
                [
                    r["label"],
                    name,
                    p["hit_rate"],
                    p["ttft_p50_s"],
                    p["ttft_p90_s"],
                    p["ttft_p99_s"],
                    p["ttft_mean_s"],
                    p["encoder_tokens"] / done,
                    p["gpu_s_per_request"],
                    p["prediction_exact_fraction"],
                ]
            )
    cols = ["load", "policy", "hit rate", "TTFT p50", "p90", "p99", "mean", "encoded tok/req", "GPU s/req",
            "predicted exactly"]  # fmt: skip
    formats = ["str", "str", "pct", "s", "s", "s", "s", "tok", "s", "pct"]
    first = results[0] if results else {}
    fleet = f"{first.get('instances', 8)} x {PROFILE}"
    title = f"{WORKLOAD} on {fleet}: {first.get('requests', 0):,} requests per run"
    return Table(cols, formats, rows, title)
