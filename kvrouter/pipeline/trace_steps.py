"""What the request path's steps put on their spans (``telemetry.RequestRecord``): counts, names and
scores, never content.  Called only for traced requests."""

from __future__ import annotations

from typing import Any

from ..api.usage import UsageReport
from ..routing import Decision, PDPlan
from ..telemetry import RequestRecord


def usage_attrs(usage: UsageReport | None) -> dict[str, int]:
    if usage is None:
        return {}
    out = {}
    for key, v in (
        ("gen_ai.usage.input_tokens", usage.prompt_tokens),
        ("gen_ai.usage.output_tokens", usage.completion_tokens),
        ("kvrouter.reported_cached_tokens", usage.cached_tokens),
    ):
        if v is not None:
            out[key] = v
    return out


def trace_decision(rec: RequestRecord, d: Decision, ns0: int, ns1: int, ns2: int) -> None:
    """The index lookup (``ns0``..``ns1``: matched blocks per tier, of the best-matching candidate and of
    the chosen one) and the ranking (``ns1``..``ns2``: policy, choice, runner-up, their scores)."""
    ranked = d.ranked
    best = None
    for r in ranked:  # the first with the most matched blocks
        if best is None or r.matched_blocks > best.matched_blocks:
            best = r
    look: dict[str, Any] = {"kvrouter.candidates": len(ranked)}
    if best is not None:
        look["kvrouter.matched_blocks"] = best.matched_blocks
        look["kvrouter.matched_target"] = best.target
        look["kvrouter.matched_blocks.GPU"] = best.gpu_blocks
        look["kvrouter.matched_blocks.speculative"] = best.speculative_blocks
        for tier, n in best.tiers.items():
            look[f"kvrouter.matched_blocks.{tier}"] = n
    rec.phase("kvrouter.index_lookup", ns0, ns1, look)
    attrs: dict[str, Any] = {"kvrouter.policy": d.policy, "kvrouter.reason": d.reason}
    c = d.chosen
    if c is not None:
        attrs["kvrouter.chosen"] = c.target
        attrs["kvrouter.chosen.score"] = float(c.score)
        attrs["kvrouter.chosen.cached_tokens"] = c.hit_tokens
        attrs["kvrouter.chosen.in_flight"] = c.in_flight
        attrs["kvrouter.chosen.blocks.GPU"] = c.gpu_blocks
        attrs["kvrouter.chosen.blocks.speculative"] = c.speculative_blocks
        for tier, n in c.tiers.items():
            attrs[f"kvrouter.chosen.blocks.{tier}"] = n
        for r in ranked:
            if r is not c:
                attrs["kvrouter.runner_up"] = r.target
                attrs["kvrouter.runner_up.score"] = float(r.score)
                attrs["kvrouter.runner_up.cached_tokens"] = r.hit_tokens
                break
    rec.phase("kvrouter.decision", ns1, ns2, attrs)


def trace_plan(rec: RequestRecord, plan: PDPlan, ns0: int, ns1: int) -> None:
    """A disaggregated model's plan: the planner looks the prompt up once and ranks both pools, so one
    lookup span and one decision span (the decode pool's choice, the prefill pool's as
    ``kvrouter.prefill.*``)."""
    trace_decision(rec, plan.decode, ns0, ns0, ns1)
    attrs = rec.phases[-1].attrs if rec.phases else {}
    attrs.update({"kvrouter.pd": "split" if plan.split else "whole", "kvrouter.pd.reason": plan.reason})
    pre = plan.prefill
    if pre is not None and pre.chosen is not None:
        attrs.update(
            {
                "kvrouter.prefill.chosen": pre.chosen.target,
                "kvrouter.prefill.score": float(pre.chosen.score),
                "kvrouter.prefill.cached_tokens": pre.chosen.hit_tokens,
            }
        )
