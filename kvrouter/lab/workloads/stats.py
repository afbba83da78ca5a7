"""Summary statistics of a workload: the columns of the traces README table."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvrouter.lab.workloads.blocks import BlockContentCache
from kvrouter.lab.workloads.bounds import reuse_ceiling
from kvrouter.lab.workloads.spec import Workload


def summarize(
    workload: Workload,
    block_size: int = 16,
    *,
    ceiling: bool = True,
    cache: BlockContentCache | None = None,
) -> dict[str, Any]:
    """Requests, span, mean rate, input mean / p50 / max, output mean, and (unless ``ceiling=False``,
    which skips hashing) the reuse ceiling at ``block_size``.

    ``span_s`` is last minus first arrival and ``mean_rate_rps`` is requests / span (None for closed-loop
    workloads or a zero span); input and output figures are in tokens (input: estimates for text
    requests not yet materialized)."""
    reqs = workload.requests
    inputs = np.fromiter((r.num_prompt_tokens for r in reqs), dtype=np.int64, count=len(reqs))
    outputs = np.fromiter((r.max_output_tokens for r in reqs), dtype=np.int64, count=len(reqs))
    times = [r.arrival_s for r in reqs if r.arrival_s is not None]
    span = (max(times) - min(times)) if len(times) == len(reqs) and times else None
    out: dict[str, Any] = {
        "name": workload.name,
        "mode": "closed-loop" if workload.closed_loop else "open-loop",
        "concurrency": getattr(workload.mode, "concurrency", None),
        "requests": len(reqs),
        "span_s": span,
        "mean_rate_rps": (len(reqs) / span) if span else None,
        "input_tokens_total": int(inputs.sum()),
        "input_mean": float(inputs.mean()) if len(reqs) else 0.0,
        "input_p50": float(np.median(inputs)) if len(reqs) else 0.0,
        "input_max": int(inputs.max()) if len(reqs) else 0,
        "output_mean": float(outputs.mean()) if len(reqs) else 0.0,
        "sessions": len({r.session_id for r in reqs if r.session_id is not None}),
        "tenants": len({r.tenant for r in reqs if r.tenant is not None}),
        "groups": len({r.group for r in reqs if r.group is not None}),
        "block_size": block_size,
    }
    if ceiling:
        out["reuse_ceiling"] = reuse_ceiling(workload, block_size, cache=cache)
    return out
