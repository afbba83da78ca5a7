"""``kvrouter eval``: every policy on one workload, in virtual time, plus the two bounds.

bounds   reuse_ceiling   an infinite single cache (whole blocks, never the last prompt token)
         pooled_cache    the same engine model with the whole fleet's capacity, speed and batch limits
                         in one instance: what perfect placement of every block could reach
policies each runs the workload through ``VirtualFleet`` (the gateway's Router + Indexer + the engine
         model); policies run in parallel processes, one per core.
"""

from __future__ import annotations

import csv
import io
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any, TypeVar

import msgspec

from kvrouter.lab.evaluation.virtual_fleet import FleetRun, FleetSimConfig, RequestRecord, VirtualFleet
from kvrouter.lab.workloads import make_workload
from kvrouter.lab.workloads.blocks import BlockContentCache
from kvrouter.lab.workloads.bounds import reuse_ceiling
from kvrouter.lab.workloads.spec import Workload
from kvrouter.percentiles import quantile
from kvrouter.routing import (
    ALL_POLICIES,
    READS_INDEX,
    ROUND_ROBIN,
    SESSION,
    DisaggSettings,
    RouterConfig,
    policy_name,
)
from kvrouter.routing.policies import PolicySettings
from kvrouter.routing.saturation import Saturation

DEFAULT_POLICIES: tuple[str, ...] = tuple(p for p in ALL_POLICIES if p != SESSION)
"""Every policy but ``session``: traces carry no session ids, so it would repeat kv-aware's run."""
_T = TypeVar("_T")


class EvalSpec(msgspec.Struct, frozen=True):
    """What to evaluate (JSON-able, so it crosses process boundaries as bytes)."""

    workload: str | None = None
    trace: str | None = None
    overrides: dict[str, Any] = {}
    fleet: FleetSimConfig = FleetSimConfig()
    policies: tuple[str, ...] = DEFAULT_POLICIES
    settings: PolicySettings = PolicySettings()
    concurrency_threshold: int = 0
    max_in_flight: int = 0
    saturation: Saturation = Saturation()
    """``routing.saturation``: e.g. ``max_prefill_tokens``, past which a request waits in the router
    for the first target to take it (late binding)."""
    speculative: bool = True
    series: bool = False
    """Keep per-request TTFTs and the load-over-time samples in the output (for plots)."""
    disagg: DisaggSettings = DisaggSettings()
    """How a fleet with prefill/decode roles (``fleet.roles``) is planned."""
    slo_ttft_s: float = 2.0
    """Service-level objective on time to first token (``slo_attainment``)."""
    slo_tpot_s: float = 0.05
    """Service-level objective on a request's mean time per output token after the first."""


def load_workload(spec: EvalSpec) -> Workload:
    if spec.trace:
        from pathlib import Path

        from kvrouter.lab.workloads.mooncake import MooncakeOptions, load_mooncake

        opts = msgspec.convert(spec.overrides, MooncakeOptions) if spec.overrides else MooncakeOptions()
        return load_mooncake(Path(spec.trace), opts)
    assert spec.workload
    return make_workload(spec.workload, **spec.overrides)


def summarize(
    run: FleetRun, *, series: bool = False, slo_ttft_s: float = 2.0, slo_tpot_s: float = 0.05
) -> dict[str, Any]:
    done = [r for r in run.records if not r.rejected and r.finish_s is not None]
    ttft = [r.first_token_s - r.arrival_s for r in done if r.first_token_s is not None]
    e2e = [r.finish_s - r.arrival_s for r in done if r.finish_s is not None]
    prompt = sum(r.prompt_tokens for r in done)
    cached = sum(r.cached_tokens for r in done)
    cpu = sum(r.cpu_tokens for r in done)
    l2 = sum(r.l2_tokens for r in done)
    out_tok = sum(r.output_tokens for r in done)
    start = min((r.arrival_s for r in run.records), default=0.0)
    span = max(run.makespan_s - start, 1e-9)
    work = run.work_tokens
    mean_work = statistics.fmean(work) if work else 0.0
    inflight = [statistics.fmean(col) for col in zip(*run.load_samples)] if run.load_samples else []
    imbalance = [max(s) / statistics.fmean(s) for s in run.load_samples if sum(s)]
    err = [abs(r.predicted_cached_tokens - r.cached_tokens) for r in done]
    decoding = [r for r in done if r.output_tokens > 1]
    tpot = [r.itl_sum_s / (r.output_tokens - 1) for r in decoding]
    stall = [r.itl_max_s for r in decoding]
    gaps = sum(r.output_tokens - 1 for r in decoding)
    reasons: dict[str, int] = {}
    for r in done:
        if r.pd_reason is not None:
            reasons[r.pd_reason] = reasons.get(r.pd_reason, 0) + 1
    res: dict[str, Any] = {
        "requests": len(run.records),
        "completed": len(done),
        "rejected": sum(1 for r in run.records if r.rejected),
        "hit_rate": cached / prompt if prompt else 0.0,
        "hit_rate_by_tier": {
            "GPU": (cached - cpu - l2) / prompt if prompt else 0.0,
            "CPU": cpu / prompt if prompt else 0.0,
            "L2": l2 / prompt if prompt else 0.0,
        },
        "ttft_mean_s": statistics.fmean(ttft) if ttft else float("nan"),
        "ttft_p50_s": quantile(ttft, 0.5),
        "ttft_p90_s": quantile(ttft, 0.9),
        "ttft_p99_s": quantile(ttft, 0.99),
        "e2e_p50_s": quantile(e2e, 0.5),
        "e2e_p90_s": quantile(e2e, 0.9),
        "throughput_tok_s": out_tok / span,
        "prompt_throughput_tok_s": prompt / span,
        "gpu_s_per_request": sum(run.busy_s) / len(done) if done else float("nan"),
        "encoder_tokens": sum(run.encoder_tokens),
        "makespan_s": span,
        "max_over_mean_load": max(work) / mean_work if mean_work else 1.0,
        "max_over_mean_in_flight": max(inflight) / statistics.fmean(inflight)
        if inflight and any(inflight)
        else 1.0,
        "imbalance_p50_over_time": quantile(imbalance, 0.5) if imbalance else 1.0,
        "prediction_abs_error_mean_tokens": statistics.fmean(err) if err else 0.0,
        "prediction_exact_fraction": sum(1 for e in err if e == 0) / len(err) if err else 1.0,
        "index_errors": run.index_errors,
        "itl_mean_s": sum(r.itl_sum_s for r in decoding) / gaps if gaps else float("nan"),
        "tpot_p50_s": quantile(tpot, 0.5),
        "tpot_p90_s": quantile(tpot, 0.9),
        "tpot_p99_s": quantile(tpot, 0.99),
        "itl_max_p50_s": quantile(stall, 0.5),
        "itl_max_p90_s": quantile(stall, 0.9),
        "itl_max_p99_s": quantile(stall, 0.99),
        "split_fraction": sum(1 for r in done if r.prefill_instance) / len(done) if done else 0.0,
        "pd_reasons": reasons,
        "transfer_tokens": sum(r.transfer_tokens for r in done),
        "slo_attainment": _slo(run.records, slo_ttft_s, slo_tpot_s),
    }
    if series:
        res["series"] = {
            "ttft_s": ttft,
            "tpot_s": tpot,
            "itl_max_s": stall,
            "load_times_s": run.load_times,
            "load_in_flight": run.load_samples,
            "work_tokens": work,
        }
    return res


def _slo(records: list[RequestRecord], ttft_s: float, tpot_s: float) -> float:
    """Fraction of all requests answered within both objectives (DistServe's goodput, as a fraction):
    first token within ``ttft_s``, and a mean time per later token within ``tpot_s``.  Rejected requests
    miss."""
    ok = 0
    for r in records:
        if r.rejected or r.first_token_s is None or r.finish_s is None:
            continue
        tpot = r.itl_sum_s / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
        ok += r.first_token_s - r.arrival_s <= ttft_s and tpot <= tpot_s
    return ok / len(records) if records else 0.0


def _router_config(spec: EvalSpec, policy: str) -> RouterConfig:
    # As a well-configured deployment: spill at the engines' max_num_seqs (beyond it a request waits for a
    # whole generation to finish), unless the spec says otherwise (-1: no threshold).
    threshold = spec.concurrency_threshold or spec.fleet.max_num_seqs
    return RouterConfig(
        policy=policy,
        concurrency_threshold=max(0, threshold),
        max_in_flight=spec.max_in_flight,
        saturation=spec.saturation,
        speculative=spec.speculative,
        shadow=False,
        settings=spec.settings,
    )


def run_one(
    spec: EvalSpec,
    policy: str,
    progress: Callable[[int], None] | None = None,
    workload: Workload | None = None,
) -> dict[str, Any]:
    w = workload or load_workload(spec)
    cache = BlockContentCache(w.token_space, spec.fleet.block_size)
    # Policies outside ``READS_INDEX`` run without KV events, lookups or speculative entries (VirtualFleet
    # skips them): the same routing with a third less work.  Only the others hash prompts, up front.
    if policy in READS_INDEX:
        cache.warm(w.requests)
    t0 = time.perf_counter()
    if policy == "pooled-cache":
        f = spec.fleet
        n = f.instances
        pooled = msgspec.structs.replace(
            f,
            events=False,
            instances=1,
            profiles=[],  # a mixed fleet's bound is n instances of its ``profile`` (pick the fastest)
            capacity_blocks=None if f.capacity_blocks is None else f.capacity_blocks * n,
            max_num_seqs=f.max_num_seqs * n,
            max_num_batched_tokens=f.max_num_batched_tokens * n,
        )
        vf = VirtualFleet(
            w,
            pooled,
            _router_config(spec, ROUND_ROBIN),
            hashes=cache,
            progress=progress,
            pooled_of=n,
        )
        run = vf.run()
    else:
        fleet = spec.fleet if policy in READS_INDEX else msgspec.structs.replace(spec.fleet, events=False)
        vf = VirtualFleet(
            w, fleet, _router_config(spec, policy), hashes=cache, progress=progress, disagg=spec.disagg
        )
        if spec.series:
            vf.router.latency.samples = []
        run = vf.run()
    res = summarize(run, series=spec.series, slo_ttft_s=spec.slo_ttft_s, slo_tpot_s=spec.slo_tpot_s)
    if policy not in READS_INDEX:  # no events: the router had nothing to predict from
        res["prediction_abs_error_mean_tokens"] = res["prediction_exact_fraction"] = None
    # The latency models learn under every policy (of the requests it placed); their error after warm-up:
    book = vf.router.latency
    res["ttft_mape"], res["tpot_mape"] = book.errors["ttft"].mape, book.errors["tpot"].mape
    res["latency_outcomes"] = book.state()["outcomes"]
    if book.samples is not None:  # each warm TTFT prediction against what came (at most 20,000)
        res["latency_samples"] = [s for s in book.samples if s[1] == "ttft"][:20_000]
    res["wall_s"] = time.perf_counter() - t0
    res["policy"] = policy
    return res


def _worker(key: str, spec_bytes: bytes, policy: str, q: Any) -> tuple[str, dict[str, Any]]:
    spec = msgspec.json.decode(spec_bytes, type=EvalSpec)
    count = 0

    def progress(n: int) -> None:
        nonlocal count
        count += n
        if count >= 200:
            q.put(count)
            count = 0

    res = run_one(spec, policy, progress)
    q.put(count)
    return key, res


def run_jobs(
    tasks: Sequence[tuple[str, EvalSpec, str]],
    *,
    jobs: int | None = None,
    show_progress: bool = True,
    desc: str = "eval",
    total: int = 0,
    meanwhile: Callable[[], _T] | None = None,
) -> tuple[dict[str, dict[str, Any]], _T | None]:
    """``run_one(spec, policy)`` for every ``(key, spec, policy)``, one process per core, results by key;
    ``meanwhile()`` runs here while the workers start (spawning and importing take seconds).  ``total``:
    requests over all tasks, for the progress bar."""
    jobs = jobs or min(len(tasks), os.cpu_count() or 1)
    bar = None
    if show_progress:
        from tqdm import tqdm

        bar = tqdm(total=total, desc=desc, unit="req", smoothing=0.05)
    results: dict[str, dict[str, Any]] = {}
    extra: _T | None = None
    ctx = mp.get_context("spawn" if jobs > 1 else "fork")
    with ctx.Manager() as mgr, ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
        q = mgr.Queue()
        futs = [pool.submit(_worker, key, msgspec.json.encode(spec), p, q) for key, spec, p in tasks]
        if meanwhile is not None:
            extra = meanwhile()
        pending = set(futs)
        while pending:
            done = {f for f in pending if f.done()}
            while not q.empty():
                n = q.get()
                if bar:
                    bar.update(n)
            for f in done:
                key, res = f.result()
                results[key] = res
            pending -= done
            time.sleep(0.1)
        while not q.empty():
            n = q.get()
            if bar:
                bar.update(n)
    if bar:
        bar.close()
    return results, extra


def evaluate(spec: EvalSpec, *, jobs: int | None = None, show_progress: bool = True) -> dict[str, Any]:
    """Bounds and every policy's figures, as the JSON ``kvrouter eval`` writes."""
    for p in spec.policies:
        policy_name(p)
    w = load_workload(spec)
    names = [*spec.policies, "pooled-cache"]
    t0 = time.perf_counter()
    # The longest jobs first (kv-aware indexes every event), so the last ones to start are short.
    order = sorted(names, key=lambda p: p not in READS_INDEX)

    def ceiling() -> float:
        cache = BlockContentCache(w.token_space, spec.fleet.block_size)
        cache.warm(w.requests)
        return reuse_ceiling(w, spec.fleet.block_size, cache=cache)

    results, bound = run_jobs(
        [(p, spec, p) for p in order],
        jobs=jobs,
        show_progress=show_progress,
        desc=f"eval {w.name}",
        total=len(w.requests) * len(names),
        meanwhile=ceiling,
    )
    pooled = results.pop("pooled-cache")
    return {
        "workload": w.name,
        "requests": len(w.requests),
        "fleet": msgspec.to_builtins(spec.fleet),
        "bounds": {"reuse_ceiling": bound, "pooled_cache": pooled["hit_rate"], "pooled_cache_run": pooled},
        "policies": {p: results[p] for p in spec.policies},
        "wall_s": time.perf_counter() - t0,
    }


CSV_FIELDS = (
    "hit_rate",
    "ttft_mean_s",
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_p99_s",
    "e2e_p50_s",
    "throughput_tok_s",
    "rejected",
    "max_over_mean_load",
)


def to_csv(result: dict[str, Any]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["policy", *CSV_FIELDS])
    for name, r in result["policies"].items():
        w.writerow([name, *(r[f] for f in CSV_FIELDS)])
    b = result["bounds"]
    w.writerow(["bound:reuse_ceiling", b["reuse_ceiling"], *[""] * (len(CSV_FIELDS) - 1)])
    w.writerow(["bound:pooled_cache", b["pooled_cache"], *[""] * (len(CSV_FIELDS) - 1)])
    return buf.getvalue()


def table(result: dict[str, Any]) -> str:
    """A plain-text table for the terminal."""
    rows = [("policy", "hit", "TTFT p50", "p90", "p99", "mean", "tok/s", "rej", "max/mean", "TTFT MAPE")]
    for name, r in result["policies"].items():
        rows.append(
            (
                name,
                f"{r['hit_rate']:.3f}",
                f"{r['ttft_p50_s']:.3f}",
                f"{r['ttft_p90_s']:.3f}",
                f"{r['ttft_p99_s']:.3f}",
                f"{r['ttft_mean_s']:.3f}",
                f"{r['throughput_tok_s']:.0f}",
                str(r["rejected"]),
                f"{r['max_over_mean_load']:.2f}",
                "-" if r.get("ttft_mape") is None else f"{r['ttft_mape']:.3f}",
            )
        )
    b = result["bounds"]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(wd) for c, wd in zip(row, widths)) for row in rows]
    lines.append(f"bounds: reuse ceiling {b['reuse_ceiling']:.3f}, pooled cache {b['pooled_cache']:.3f}")
    return "\n".join(lines)
