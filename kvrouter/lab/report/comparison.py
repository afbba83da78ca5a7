"""Notebook 1: kv-aware against prefix-hash (and cache-blind policies) on every registered workload, and
prefix-hash's own two settings swept.

Sizes at full scale (chosen so the whole notebook runs in about five minutes on two cores): each generated
workload keeps its peer's shape (groups, lengths, arrival process) and is cut to a few hundred to ~2,000
requests (staged schedules keep every stage, shortened); the Mooncake conversation trace is its first 2,500
requests sent 3x as fast as recorded.  At 1x our eight modelled Llama-3.1-70B instances would compute its
prompts at about a quarter of their prefill capacity, where any policy looks fine; 3x puts them near
three quarters (the load at which kv-aware's weights were tuned).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from kvrouter.lab.evaluation.compare import EvalSpec
from kvrouter.lab.evaluation.virtual_fleet import FleetSimConfig
from kvrouter.lab.report.grid import Case, with_param
from kvrouter.lab.report.scale import Scale, sized
from kvrouter.lab.report.study import Study
from kvrouter.lab.workloads.registry import describe, list_workloads
from kvrouter.routing import KV_AWARE, LEAST_LOADED, PREFIX_HASH, RANDOM, ROUND_ROBIN

POLICIES = (KV_AWARE, PREFIX_HASH, LEAST_LOADED, ROUND_ROBIN)

MOONCAKE = "mooncake-conversation"
MOONCAKE_SLICE: Mapping[str, Any] = MappingProxyType({"limit": 2500, "rate_multiplier": 3.0})

SIZES: Mapping[str, tuple[Mapping[str, Any], float]] = MappingProxyType(
    {
        "aws-8k-shared-prefix": ({"num_requests": 1200}, 1.0),
        "dynamo-prefix-ratio": ({}, 1.0),
        "llmd-precise": ({}, 0.1),
        "llmd-shared-prefix": ({}, 0.34),
        "llmd-tiered": ({}, 0.25),
        "multi-turn": ({}, 1.0),
        "rag": ({"num_requests": 1000}, 1.0),
        "sglang-gsp": ({}, 1.0),
        "short-chat": ({}, 1.0),
        "tenants": ({}, 1.0),
        "vllm-prefix-repetition": ({}, 1.0),
        "mooncake-synthetic": ({"limit": 1000}, 1.0),
        MOONCAKE: (MOONCAKE_SLICE, 1.0),
    }
)
"""Per workload: overrides, then the fraction ``sized`` keeps (full scale)."""


def instances_for(name: str) -> int:
    """The instance count the workload's peer used (its registry hint), else 8."""
    return int(describe(name)["hints"].get("instances", 8))


def profile_for(name: str) -> str:
    """The timing profile the workload names (its registry hint: a vision model for images), else the
    fleet's default."""
    return str(describe(name)["hints"].get("profile", FleetSimConfig().profile))


def workload_spec(name: str, scale: Scale, *, policies: tuple[str, ...] = POLICIES) -> EvalSpec:
    over, fraction = SIZES.get(name, ({}, 1.0))
    spec = EvalSpec(
        workload=name,
        overrides=dict(over),
        fleet=FleetSimConfig(instances=instances_for(name), profile=profile_for(name)),
        policies=policies,
        series=True,
    )
    if fraction != 1.0:
        spec = sized(spec, fraction)
    return scale.size(spec)


def workload_cases(scale: Scale) -> list[Case]:
    """Every registered workload; the Mooncake conversation trace also under random (the Mooncake paper's
    baseline)."""
    cases = []
    for name in list_workloads():
        pols = (*POLICIES, RANDOM) if name == MOONCAKE else POLICIES
        cases.append(Case(name, workload_spec(name, scale, policies=pols)))
    return cases


PREFIX_LENGTHS = (256, 1024, 4096, 16384, 65536)
"""Characters hashed (SageMaker allows 1024..65536); token-id prompts are hashed as the gateway sees
them, ids joined by spaces (about 6.7 characters a token)."""
LOAD_BOUNDS = (1.05, 1.25, 1.5, 2.0, 4.0)

SWEEP_WORKLOADS: Mapping[str, tuple[Mapping[str, Any], float]] = MappingProxyType(
    {
        MOONCAKE: ({"limit": 1000, "rate_multiplier": 3.0}, 1.0),
        "llmd-shared-prefix": ({}, 0.34),
    }
)


def prefix_hash_studies(scale: Scale) -> list[Study]:
    """prefix_length and load_bound swept on a multi-turn trace and on a groups-of-prompts workload, with
    kv-aware (which reads neither setting) as the reference."""
    out = []
    for name, (over, fraction) in SWEEP_WORKLOADS.items():
        base = EvalSpec(
            workload=name,
            overrides=dict(over),
            fleet=FleetSimConfig(instances=8),
            policies=(PREFIX_HASH,),
        )
        base = scale.size(sized(base, fraction) if fraction != 1.0 else base)
        ref = Case("reference", with_param(base, "policies", (KV_AWARE,)), bounds=False)
        for path, values, label in (
            ("settings.prefix_hash.prefix_length", PREFIX_LENGTHS, "prefix_length (characters)"),
            ("settings.prefix_hash.load_bound", LOAD_BOUNDS, "load_bound"),
        ):
            cases = [
                Case(f"{label}={v}", with_param(base, path, v), v, bounds=False) for v in scale.values(values)
            ]
            key = path.rsplit(".", 1)[-1]
            out.append(
                Study(
                    f"{name}:{key}",
                    f"prefix-hash {key} on {name}",
                    cases,
                    ref,
                    label,
                    log_x=True,
                )
            )
    return out
