"""``kvrouter eval --flows``: tenants and priorities under saturation, every fairness mode in the same runs.

The trace: ``interactive`` tenants (priority 1, one system prompt each), one ``noisy`` tenant of the same
priority and weight at five times an interactive tenant's rate, and a ``batch`` tenant at priority 0
(long prompts, long outputs); ``load`` scales every rate.  Saturation is the fleet's own signal
(``limits.saturation``), with a share kept for priority 1 flows, the same in every mode; ``work+quiet``
also keeps ``quiet_share`` of the instances from heavy flows (``limits.isolation``).  For each load and
each mode (``MODES``), three runs of the same trace: ``full`` (every tenant), ``no_batch`` (without the
batch tenant) and ``alone`` (each interactive tenant by itself, once per load).

Figures, against ``fifo`` in the same runs: ``ttft_p99_vs_alone``, ``high_p99_vs_no_batch``,
``jain_work`` and ``throughput_vs_fifo`` (each defined in docs/flows.md, "Evaluation and the live
scenario").  Tokens computed: prompt tokens vLLM did not serve from cache plus output tokens, of answered
requests; a refused request's demand is its whole prompt and output.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import msgspec
import numpy as np

from kvrouter.flows import FAIRNESS
from kvrouter.lab.evaluation.virtual_fleet import FleetRun, FleetSimConfig, VirtualFleet
from kvrouter.lab.workloads.arrivals import sort_requests
from kvrouter.lab.workloads.build import Keys
from kvrouter.lab.workloads.spec import OpenLoop, Request, Segment, TokenSpace, Workload
from kvrouter.percentiles import quantile
from kvrouter.routing import KV_AWARE, RouterConfig
from kvrouter.routing.isolation import Isolation
from kvrouter.routing.saturation import Saturation


class FlowsSpec(msgspec.Struct, frozen=True):
    loads: tuple[float, ...] = (1.0, 3.0)
    duration_s: float = 30.0
    interactive: int = 3
    interactive_rate: float = 1.5
    """Requests per second of each interactive tenant at load 1."""
    noisy_factor: float = 5.0
    batch_rate: float = 0.5
    system_len: int = 1024
    question_len: int = 128
    output_len: int = 64
    batch_prompt_len: int = 4096
    batch_output_len: int = 256
    instances: int = 2
    profile: str = "llama-3.1-70b-8xh100"
    max_in_flight: int = 0
    """``limits.max_in_flight`` (0: no fixed cap: saturation is read from the prefill backlog)."""
    max_prefill_tokens: int = 2048
    """``limits.saturation.max_prefill_tokens`` (0: the cap alone)."""
    reserve: float = 0.5
    """``limits.saturation.reserve``, kept for priority 1 (the fair modes; ``fifo`` knows no priority)."""
    quiet_share: float = 0.5
    """``limits.isolation.quiet_share`` of the ``+quiet`` modes (``MODES``)."""
    queue_size: int = 4096
    seed: int = 0


def flows_trace(spec: FlowsSpec, load: float, *, batch: bool = True, only: str | None = None) -> Workload:
    """The multi-tenant trace at ``load``; ``only``: that tenant's requests alone."""
    rng = np.random.default_rng(spec.seed)
    keys = Keys(spec.seed, "flows")
    tenants: list[tuple[str, float]] = [
        (f"interactive-{i}", spec.interactive_rate) for i in range(spec.interactive)
    ]
    tenants.append(("noisy", spec.interactive_rate * spec.noisy_factor))
    tenants.append(("batch", spec.batch_rate))
    reqs: list[Request] = []
    for name, rate in tenants:
        # Every tenant's arrivals drawn in every variant, so a tenant's requests are the same in each.
        gaps = rng.exponential(1.0 / (rate * load), size=int(rate * load * spec.duration_s * 2) + 16)
        times = np.cumsum(gaps)
        times = times[times < spec.duration_s]
        if (only is not None and name != only) or (name == "batch" and not batch):
            continue
        for j, t in enumerate(times.tolist()):
            segs: tuple[Segment, ...]
            if name == "batch":
                segs = (keys.segment(spec.batch_prompt_len, "batch", j),)
                out = spec.batch_output_len
            elif name == "noisy":
                segs = (keys.segment(spec.system_len, "noisy", j), keys.segment(spec.question_len, "nq", j))
                out = spec.output_len
            else:
                segs = (
                    keys.segment(spec.system_len, "system", name),
                    keys.segment(spec.question_len, name, j),
                )
                out = spec.output_len
            reqs.append(
                Request(
                    id=f"{name}-{j:06d}",
                    arrival_s=float(t),
                    max_output_tokens=out,
                    num_prompt_tokens=sum(s.length for s in segs),
                    segments=segs,
                    tenant=name,
                )
            )
    return Workload(
        name=f"flows-x{load:g}",
        requests=sort_requests(reqs),
        mode=OpenLoop(),
        token_space=TokenSpace(),
        metadata={"generator": "flows", "params": msgspec.to_builtins(spec), "hints": {}},
    )


def _priorities(spec: FlowsSpec) -> dict[str, int]:
    return {"noisy": 1, "batch": 0, **{f"interactive-{i}": 1 for i in range(spec.interactive)}}


MODES = (*FAIRNESS, "work+quiet")
"""Every fairness mode, and ``work`` with quiet targets (``limits.isolation.quiet_share``)."""


def run_case(spec: FlowsSpec, load: float, mode: str, variant: str) -> dict[str, Any]:
    """``mode``: a fairness mode, ``+quiet`` for quiet targets; ``variant``: ``full``, ``no_batch`` or
    ``alone:<tenant>``."""
    fairness, _, quiet = mode.partition("+")
    only = variant.partition(":")[2] if variant.startswith("alone:") else None
    w = flows_trace(spec, load, batch=variant != "no_batch", only=only)
    fleet = FleetSimConfig(
        instances=spec.instances,
        profile=spec.profile,
        queue_size=spec.queue_size,
        fairness=fairness,  # type: ignore[arg-type]
        priorities=_priorities(spec),
        seed=spec.seed,
    )
    sat = Saturation(max_prefill_tokens=spec.max_prefill_tokens, reserve=spec.reserve, reserved_priority=1)
    iso = Isolation(quiet_share=spec.quiet_share if quiet else 0.0, quiet_priority=1)
    router = RouterConfig(
        policy=KV_AWARE, max_in_flight=spec.max_in_flight, saturation=sat, isolation=iso, shadow=False
    )
    run = VirtualFleet(w, fleet, router).run()
    return summarize_flows(run, w, spec.duration_s)


def summarize_flows(run: FleetRun, w: Workload, until_s: float) -> dict[str, Any]:
    by_id = {r.id: r for r in w.requests}
    per: dict[str, dict[str, Any]] = {}
    for rec in run.records:
        t = by_id[rec.id].tenant or "default"
        d = per.setdefault(
            t, {"ttft": [], "computed": 0, "demand": 0, "rejected": 0, "requests": 0, "in_window": 0}
        )
        d["requests"] += 1
        r = by_id[rec.id]
        if rec.rejected or rec.first_token_s is None:
            d["rejected"] += 1
            d["demand"] += r.num_prompt_tokens + r.max_output_tokens
            continue
        work = max(0, rec.prompt_tokens - rec.cached_tokens) + rec.output_tokens
        d["computed"] += work
        d["demand"] += work
        if rec.finish_s is not None and rec.finish_s <= until_s:
            d["in_window"] += work
        d["ttft"].append(rec.first_token_s - rec.arrival_s)
    out: dict[str, Any] = {"makespan_s": run.makespan_s, "tenants": {}}
    total = 0
    for t, d in sorted(per.items()):
        total += d["computed"]
        out["tenants"][t] = {
            "requests": d["requests"],
            "rejected": d["rejected"],
            "ttft_p50_s": quantile(d["ttft"], 0.5),
            "ttft_p99_s": quantile(d["ttft"], 0.99),
            "tokens_computed": d["computed"],
            "tokens_demanded": d["demand"],
            "tokens_computed_in_window": d["in_window"],
        }
    out["tokens_computed"] = total
    out["throughput_tokens_per_s"] = total / run.makespan_s if run.makespan_s else 0.0
    return out


def max_min_shares(demands: list[float], capacity: float) -> list[float]:
    """Water-filling: each gets min(demand, an equal share of what is left)."""
    alloc = [0.0] * len(demands)
    left = sorted(range(len(demands)), key=lambda i: demands[i])
    cap = capacity
    while left:
        share = cap / len(left)
        i = left[0]
        if demands[i] <= share:
            alloc[i] = demands[i]
            cap -= demands[i]
            left.pop(0)
        else:
            for j in left:
                alloc[j] = share
            break
    return alloc


def jain(xs: list[float]) -> float:
    s, s2 = sum(xs), sum(x * x for x in xs)
    return (s * s) / (len(xs) * s2) if s2 else 1.0


def _jain_work(res: dict[str, Any], group: list[str]) -> float:
    ts = res["tenants"]
    demands = [float(ts[t]["tokens_demanded"]) for t in group if t in ts]
    got = [float(ts[t]["tokens_computed_in_window"]) for t in group if t in ts]
    fair = max_min_shares(demands, sum(got))
    return jain([g / f if f else 1.0 for g, f in zip(got, fair)])


def _high_p99(res: dict[str, Any], group: list[str]) -> float:
    return max(res["tenants"][t]["ttft_p99_s"] for t in group if t in res["tenants"])


def evaluate_flows(
    spec: FlowsSpec,
    fairness: tuple[str, ...] = MODES,
    *,
    jobs: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    cases = [(load, f, v) for load in spec.loads for f in fairness for v in ("full", "no_batch")]
    interactive = [f"interactive-{i}" for i in range(spec.interactive)]
    cases += [(load, "fifo", f"alone:{t}") for load in spec.loads for t in interactive]
    with ProcessPoolExecutor(max_workers=jobs) as ex:
        futs = {c: ex.submit(run_case, spec, *c) for c in cases}
        results = {}
        for c, fut in futs.items():
            results[c] = fut.result()
            if progress is not None:
                progress(f"load x{c[0]:g} {c[1]} {c[2]}")
    group = [*interactive, "noisy"]
    report: dict[str, Any] = {"spec": msgspec.to_builtins(spec), "loads": {}}
    for load in spec.loads:
        alone = {t: results[(load, "fifo", f"alone:{t}")]["tenants"][t]["ttft_p99_s"] for t in interactive}
        fifo_tp = results[(load, "fifo", "full")]["throughput_tokens_per_s"]
        rows = {}
        for f in fairness:
            full, nob = results[(load, f, "full")], results[(load, f, "no_batch")]
            rows[f] = {
                "ttft_p99_vs_alone": {t: full["tenants"][t]["ttft_p99_s"] / alone[t] for t in interactive},
                "high_p99_vs_no_batch": _high_p99(full, interactive) / _high_p99(nob, interactive),
                "jain_work": _jain_work(full, group),
                "throughput_vs_fifo": full["throughput_tokens_per_s"] / fifo_tp,
                "full": full,
                "no_batch": nob,
            }
        report["loads"][f"x{load:g}"] = {"alone_ttft_p99_s": alone, "fairness": rows}
    return report


def flows_table(report: dict[str, Any]) -> str:
    lines = [
        "load  fairness  worst interactive p99/alone  high p99 full/no-batch  jain(work)  "
        "throughput/fifo  noisy p99 (s)  batch refused"
    ]
    for load, row in report["loads"].items():
        for f, r in row["fairness"].items():
            worst = max(r["ttft_p99_vs_alone"].values())
            ts = r["full"]["tenants"]
            lines.append(
                f"{load:<5} {f:<10} {worst:>26.2f}  {r['high_p99_vs_no_batch']:>22.3f}"
                f"  {r['jain_work']:>10.3f}  {r['throughput_vs_fifo']:>15.3f}"
                f"  {ts['noisy']['ttft_p99_s']:>13.2f}"
                f"  {ts.get('batch', {}).get('rejected', 0):>13}"
            )
    return "\n".join(lines)
