"""Policies x KV tiers: what an instance's CPU tier (L1) and a shared store (L2) buy, and what routing
still adds on top of them, beside HyperPod's published figures.

``tier_cases(base, sizes, rates)`` gives a Case per (load, tier setting), each running every policy
through ``run_grid``; ``tier_table`` reports TTFT, throughput, hit rate by tier and GPU time per request
against GPU-only round-robin at the same load; ``hyperpod_table`` sets the best of each tier setting
beside HyperPod's claims.

Tier settings: ``gpu`` (prefix caching on the GPU only), ``l1`` (+ each instance's CPU tier, vLLM's
OffloadingConnector), ``l1+l2`` (+ one store every instance attaches and loads from at its bandwidth,
announcing no removals).  Cost is GPU time: the seconds instances spend in engine steps per completed
request, so a hit that saves prefill saves cost even when the fleet is not saturated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import msgspec

from kvrouter.lab.evaluation.compare import EvalSpec
from kvrouter.lab.evaluation.virtual_fleet import FleetSimConfig
from kvrouter.lab.report.grid import Case, with_rate
from kvrouter.lab.report.published import HYPERPOD_TIERED
from kvrouter.lab.report.scale import Scale
from kvrouter.lab.report.tables import Table, change

Result = dict[str, Any]

TIER_SETTINGS = ("gpu", "l1", "l1+l2")
BASELINE = ("gpu", "round-robin")


class TierSizes(msgspec.Struct, frozen=True):
    """Capacities per tier, in blocks (per instance, except the shared L2)."""

    gpu_blocks: int | None = None
    """KV blocks on each instance's GPUs (None: the profile's)."""
    l1_blocks: int = 0
    """Each instance's CPU tier."""
    l2_blocks: int = 0
    """The shared store."""
    l2_gbps: float = 12.5
    """The shared store's load bandwidth."""


def tier_of(fleet: dict[str, Any]) -> str:
    """The tier setting a run's fleet had (its ``FleetSimConfig`` as builtins)."""
    if fleet.get("shared_l2_blocks"):
        return "l1+l2" if fleet.get("cpu_offload_blocks") else "l2"
    return "l1" if fleet.get("cpu_offload_blocks") else "gpu"


def tier_cases(
    base: EvalSpec, sizes: TierSizes, rates: Sequence[float], *, label: str | None = None
) -> list[Case]:
    """One case per (load, tier setting): ``base`` sent ``rate`` times as fast (``with_rate``), its fleet
    given the tiers of the setting.  ``label``: the workload's name in tables (default: its own)."""
    name = label or base.workload or base.trace or "workload"
    out = []
    for rate in rates:
        spec = base if rate == 1 else with_rate(base, rate)
        for tier in TIER_SETTINGS:
            fleet = msgspec.structs.replace(
                spec.fleet,
                capacity_blocks=sizes.gpu_blocks,
                cpu_offload_blocks=sizes.l1_blocks if "l1" in tier else 0,
                shared_l2_blocks=sizes.l2_blocks if "l2" in tier else 0,
                shared_l2_gbps=sizes.l2_gbps,
            )
            out.append(Case(name, msgspec.structs.replace(spec, fleet=fleet), rate, bounds=False))
    return out


# The notebook's study (notebooks/05_tiers.ipynb).  Four instances of Llama-3.1-70B on 8 x H100 whose
# GPUs keep 8,192 blocks (131k tokens) of KV each: a fleet under long-context pressure, as HyperPod's
# setting is (its claims are for long prompts and multi-turn chat).  L1: 32,768 blocks per instance (537k
# tokens, 176 GB of host memory at 327,680 bytes a token); L2: 262,144 blocks (4.3M tokens, 1.4 TB) at
# one 100 Gb/s link's 12.5 GB/s.
STUDY_FLEET = FleetSimConfig(instances=4)
STUDY_SIZES = TierSizes(gpu_blocks=8192, l1_blocks=32768, l2_blocks=262144, l2_gbps=12.5)
STUDY_POLICIES = ("round-robin", "prefix-hash", "kv-aware")
# Each workload at a light load and a heavy one (its own rate multipliers: the Mooncake trace at its
# recorded rate already queues on four instances).
STUDY_WORKLOADS: tuple[tuple[str, str, dict[str, Any], tuple[float, ...]], ...] = (
    # agent sessions: each its own 3,000-token instructions, 800-token tool results per turn
    (
        "agent",
        "multi-turn",
        {
            "num_conversations": 32,
            "turns": 6,
            "system_len": 3000,
            "shared_system": False,
            "turn_len": 800,
            "output_len": 150,
            "think_time_s": 5.0,
        },
        (1.0, 8.0),
    ),
    (
        "aws-8k",
        "aws-8k-shared-prefix",
        {"arrival": {"type": "poisson", "rate": 2.0}, "num_requests": 160},
        (1.0, 8.0),
    ),
    ("mooncake", "mooncake-conversation", {"limit": 400}, (0.25, 1.0)),
)


def study_cases(scale: Scale) -> list[Case]:
    """The notebook's grid at ``scale``: every workload, load and tier setting, the three policies."""
    out: list[Case] = []
    for label, workload, overrides, rates in STUDY_WORKLOADS:
        spec = EvalSpec(workload=workload, overrides=overrides, fleet=STUDY_FLEET, policies=STUDY_POLICIES)
        out += tier_cases(scale.size(spec), STUDY_SIZES, scale.values(rates), label=label)
    return out


def labelled(results: Sequence[Result]) -> list[Result]:
    """Copies of ``results`` labelled ``workload xload tiers`` (for charts of one bar group per case)."""
    return [{**r, "label": f"{r['label']} x{r['x']:g} {tier_of(r['fleet'])}"} for r in results]


def _baselines(results: Sequence[Result]) -> dict[tuple[str, Any], Result]:
    out: dict[tuple[str, Any], Result] = {}
    for r in results:
        if tier_of(r["fleet"]) == BASELINE[0] and BASELINE[1] in r["policies"]:
            out[(r["label"], r["x"])] = r["policies"][BASELINE[1]]
    return out


def tier_table(results: Sequence[Result]) -> Table:
    """Every (workload, load, tier setting, policy): its figures and its changes against GPU-only
    round-robin at the same workload and load."""
    base = _baselines(results)
    rows = []
    for r in results:
        b = base.get((r["label"], r["x"]))
        for policy, p in r["policies"].items():
            by = p.get("hit_rate_by_tier", {})
            rows.append(
                [
                    r["label"],
                    f"x{r['x']:g}",
                    tier_of(r["fleet"]),
                    policy,
                    p["ttft_p50_s"],
                    p["ttft_p90_s"],
                    p["throughput_tok_s"],
                    by.get("GPU", p["hit_rate"]),
                    by.get("CPU", 0.0),
                    by.get("L2", 0.0),
                    p.get("gpu_s_per_request", math.nan),
                    change(p["ttft_p50_s"], b["ttft_p50_s"]) if b else math.nan,
                    change(p["throughput_tok_s"], b["throughput_tok_s"]) if b else math.nan,
                    change(p.get("gpu_s_per_request", math.nan), b.get("gpu_s_per_request", math.nan))
                    if b
                    else math.nan,
                    p["rejected"],
                ]
            )
    return Table(
        [
            "workload",
            "load",
            "tiers",
            "policy",
            "TTFT p50",
            "TTFT p90",
            "tok/s",
            "hit GPU",
            "hit CPU",
            "hit L2",
            "GPU s/req",
            "TTFT p50 vs base",
            "tok/s vs base",
            "cost vs base",
            "rejected",
        ],
        ["str", "str", "str", "str", "s", "s", "tok", "pct", "pct", "pct", "x", "chg", "chg", "chg", "int"],
        rows,
        title="Policy x tiers, changes against GPU-only round-robin at the same load",
    )


def hyperpod_table(results: Sequence[Result], policy: str = "kv-aware") -> Table:
    """``policy`` with each tier setting against GPU-only round-robin, per workload and load, with
    HyperPod's published changes (routing + tiered cache, long-context multi-turn) in the last row."""
    base = _baselines(results)
    rows: list[list[Any]] = []
    for r in results:
        b = base.get((r["label"], r["x"]))
        p = r["policies"].get(policy)
        if b is None or p is None:
            continue
        rows.append(
            [
                r["label"],
                f"x{r['x']:g}",
                f"{policy}, {tier_of(r['fleet'])}",
                change(p["ttft_p50_s"], b["ttft_p50_s"]),
                change(p["ttft_mean_s"], b["ttft_mean_s"]),
                change(p["throughput_tok_s"], b["throughput_tok_s"]),
                change(p.get("gpu_s_per_request", math.nan), b.get("gpu_s_per_request", math.nan)),
            ]
        )
    h = HYPERPOD_TIERED
    rows.append(
        [
            "HyperPod (published)",
            "—",
            "routing + L1 + L2",
            h["ttft"].text(),
            h["ttft"].text(),
            h["throughput"].text(),
            h["cost"].text(),
        ]
    )
    return Table(
        ["workload", "load", "setting", "TTFT p50", "TTFT mean", "throughput", "cost per request"],
        ["str", "str", "str", "chg", "chg", "chg", "chg"],
        rows,
        title=f"{policy} with tiers against GPU-only round-robin, beside HyperPod's claims",
    )
