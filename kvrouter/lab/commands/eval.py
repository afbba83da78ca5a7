"""``kvrouter eval --trace FILE | --workload NAME --instances N [--policies ...] [--json OUT]``.

``--roles 3P1D``: a disaggregated fleet of those instances, run aggregated, disaggregated and conditionally
disaggregated, each with a kv-aware and a load-only prefill choice (``--setups``), instead of policies.

``--flows``: the multi-tenant trace (interactive tenants, a noisy one, a low-priority batch one) at each
``--loads`` multiplier, under every fairness mode in the same runs (``lab.evaluation.flows``)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import msgspec

from kvrouter.lab.evaluation.compare import DEFAULT_POLICIES, EvalSpec, evaluate, table, to_csv
from kvrouter.lab.evaluation.flows import FlowsSpec, evaluate_flows, flows_table
from kvrouter.lab.evaluation.pd import DEFAULT_SETUPS, evaluate_pd, pd_table
from kvrouter.lab.evaluation.virtual_fleet import FleetSimConfig
from kvrouter.lab.sim.engine.timing import parse_profiles
from kvrouter.lab.sim.errors import SimError
from kvrouter.routing import DisaggSettings
from kvrouter.routing.disagg import parse_roles
from kvrouter.routing.policies import (
    KvAwareSettings,
    PolicySettings,
    PredictedLatencySettings,
    PrefixHashSettings,
)
from kvrouter.routing.saturation import Saturation


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="a Mooncake-format JSONL trace")
    src.add_argument("--workload", help="a generated workload (see --list)")
    src.add_argument("--list", action="store_true", help="list the generated workloads and exit")
    src.add_argument(
        "--flows",
        action="store_true",
        help="tenants and priorities: every fairness mode (and work+quiet), same runs",
    )
    f = p.add_argument_group("--flows")
    f.add_argument("--loads", default="1,3", help="arrival-rate multipliers, comma-separated")
    f.add_argument("--duration", type=float, default=FlowsSpec().duration_s, help="seconds of trace")
    f.add_argument("--interactive-rate", type=float, default=FlowsSpec().interactive_rate)
    f.add_argument("--batch-rate", type=float, default=FlowsSpec().batch_rate)
    f.add_argument("--flows-instances", type=int, default=FlowsSpec().instances)
    f.add_argument("--flows-max-in-flight", type=int, default=FlowsSpec().max_in_flight)
    f.add_argument(
        "--flows-max-prefill-tokens",
        type=int,
        default=FlowsSpec().max_prefill_tokens,
        help="limits.saturation.max_prefill_tokens (0: the cap alone)",
    )
    f.add_argument(
        "--flows-reserve",
        type=float,
        default=FlowsSpec().reserve,
        help="limits.saturation.reserve, kept for priority 1 in the fair modes",
    )
    f.add_argument(
        "--flows-quiet-share",
        type=float,
        default=FlowsSpec().quiet_share,
        help="limits.isolation.quiet_share in the fair modes (0: no quiet targets)",
    )
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=JSON", help="workload parameter override"
    )
    p.add_argument("--instances", type=int, default=8)
    p.add_argument(
        "--predicted-latency",
        default="{}",
        metavar="JSON",
        help="the predicted-latency policy's settings as JSON, e.g. "
        '\'{"recompute_weight": 2, "model": {"warmup": 32}}\'',
    )
    p.add_argument(
        "--profile",
        default=None,
        help="timing profile (default: the workload's hint, else llama-3.1-70b-8xh100)",
    )
    p.add_argument(
        "--profiles",
        default=None,
        metavar="LIST",
        help="a mixed fleet: each instance's profile, e.g. llama-3.1-70b-8xh100*2,llama-3.1-70b-8xa100*2 "
        "(sets --instances; the pooled-cache bound stays n x --profile)",
    )
    p.add_argument(
        "--capacity-blocks", type=int, default=None, help="KV blocks per instance (default: profile)"
    )
    p.add_argument(
        "--cpu-offload-blocks", type=int, default=0, help="each instance's CPU tier (L1), blocks (0: none)"
    )
    p.add_argument(
        "--l2-blocks", type=int, default=0, help="a shared L2 every instance attaches, blocks (0: none)"
    )
    p.add_argument("--l2-gbps", type=float, default=12.5, help="the L2's load bandwidth, GB/s")
    p.add_argument(
        "--tier-grid",
        action="store_true",
        help="run every policy with GPU only, + L1, + L1 + L2 (sizes: --capacity-blocks, "
        "--cpu-offload-blocks, --l2-blocks) at each --rates multiplier; print both tier tables",
    )
    p.add_argument("--rates", default="1", help="tier grid: arrival-rate multipliers, comma-separated")
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
    p.add_argument(
        "--event-delay", type=float, default=0.005, help="seconds from engine step to router index"
    )
    p.add_argument("--event-loss", type=float, default=0.0, help="fraction of event batches lost")
    p.add_argument("--net-latency", type=float, default=0.0005)
    p.add_argument(
        "--prompt-api",
        choices=("chat", "completion", "token_ids"),
        default="chat",
        help="how prompts without messages or text reach vLLM (its API server's cost depends on it)",
    )
    p.add_argument(
        "--no-frontend", action="store_true", help="leave vLLM's API server out (engine-only TTFT)"
    )
    p.add_argument("--prefix-length", type=int, default=1024, help="prefix-hash: characters hashed")
    p.add_argument("--load-bound", type=float, default=1.25, help="prefix-hash: bounded-load factor")
    p.add_argument("--compute-weight", type=float, default=KvAwareSettings().compute_weight)
    p.add_argument("--load-weight", type=float, default=KvAwareSettings().load_weight)
    p.add_argument(
        "--placement-band",
        type=float,
        default=KvAwareSettings().placement_band,
        help="kv-aware: cost band within which a new prefix is placed by cache fill and the ring",
    )
    p.add_argument(
        "--concurrency-threshold",
        type=int,
        default=0,
        help="spill threshold (0: the engines' max_num_seqs; -1: none)",
    )
    p.add_argument("--max-in-flight", type=int, default=0)
    p.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=0,
        help="routing.saturation.max_prefill_tokens: past it a request waits in the router (0: none)",
    )
    p.add_argument("--jobs", type=int, default=None, help="processes (default: one per core)")
    p.add_argument("--series", action="store_true", help="include per-request TTFTs and load samples")
    p.add_argument("--json", dest="json_out", help="write the result JSON here")
    p.add_argument("--csv", dest="csv_out", help="write a CSV summary here")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    d = p.add_argument_group("disaggregated prefill/decode")
    d.add_argument("--roles", default=None, metavar="SPEC", help="e.g. 3P1D: compare setups on these roles")
    d.add_argument("--setups", default=",".join(DEFAULT_SETUPS), help="setups to run with --roles")
    d.add_argument("--local-prefill-tokens", type=int, default=DisaggSettings().local_prefill_tokens)
    d.add_argument("--prefill-busy-ratio", type=float, default=DisaggSettings().prefill_busy_ratio)
    d.add_argument("--decode-cache-weight", type=float, default=DisaggSettings().decode_cache_weight)
    d.add_argument(
        "--kv-bandwidth", type=float, default=FleetSimConfig().kv_bandwidth_bytes_per_s, help="bytes/s"
    )
    d.add_argument("--slo-ttft", type=float, default=EvalSpec().slo_ttft_s, help="seconds")
    d.add_argument("--slo-tpot", type=float, default=EvalSpec().slo_tpot_s, help="seconds per token")


def parse_sets(items: list[str]) -> dict[str, Any]:
    """``--set KEY=JSON`` options as a dict; a value that is not JSON is taken as a string."""
    out: dict[str, Any] = {}
    for kv in items:
        k, _, v = kv.partition("=")
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def _profile(a: argparse.Namespace) -> str:
    if a.profile:
        return str(a.profile)
    if a.workload:
        from kvrouter.lab.workloads.errors import UnknownWorkload
        from kvrouter.lab.workloads.registry import describe

        try:
            return str(describe(a.workload)["hints"].get("profile", FleetSimConfig().profile))
        except UnknownWorkload:
            pass  # the evaluation names the unknown workload
    return FleetSimConfig().profile


def spec_from_args(a: argparse.Namespace) -> EvalSpec:
    overrides = parse_sets(a.set)
    profiles = parse_profiles(a.profiles) if a.profiles else []
    return EvalSpec(
        workload=a.workload,
        trace=a.trace,
        overrides=overrides,
        fleet=FleetSimConfig(
            instances=len(profiles) or a.instances,
            profile=_profile(a),
            profiles=profiles,
            capacity_blocks=a.capacity_blocks,
            cpu_offload_blocks=a.cpu_offload_blocks,
            shared_l2_blocks=a.l2_blocks,
            shared_l2_gbps=a.l2_gbps,
            event_delay_s=a.event_delay,
            event_loss=a.event_loss,
            net_latency_s=a.net_latency,
            seed=a.seed,
            frontend=not a.no_frontend,
            prompt_api=a.prompt_api,
            kv_bandwidth_bytes_per_s=a.kv_bandwidth,
        ),
        policies=tuple(p for p in a.policies.split(",") if p),
        settings=PolicySettings(
            kv_aware=KvAwareSettings(
                compute_weight=a.compute_weight, load_weight=a.load_weight, placement_band=a.placement_band
            ),
            prefix_hash=PrefixHashSettings(prefix_length=a.prefix_length, load_bound=a.load_bound),
            predicted_latency=msgspec.json.decode(a.predicted_latency, type=PredictedLatencySettings),
            seed=a.seed,
        ),
        concurrency_threshold=a.concurrency_threshold,
        max_in_flight=a.max_in_flight,
        saturation=Saturation(max_prefill_tokens=a.max_prefill_tokens),
        series=a.series,
        disagg=DisaggSettings(
            local_prefill_tokens=a.local_prefill_tokens,
            prefill_busy_ratio=a.prefill_busy_ratio,
            decode_cache_weight=a.decode_cache_weight,
        ),
        slo_ttft_s=a.slo_ttft,
        slo_tpot_s=a.slo_tpot,
    )


def run(a: argparse.Namespace) -> int:
    if a.list:
        from kvrouter.lab.workloads.registry import describe, list_workloads

        for name in list_workloads():
            print(f"{name}: {describe(name).get('summary', '')}")
        return 0
    if a.tier_grid:
        return _tier_grid(a)
    if a.flows:
        return _flows(a)
    try:
        spec = spec_from_args(a)
        if a.roles:
            setups = [x for x in a.setups.split(",") if x]
            result = evaluate_pd(
                spec, parse_roles(a.roles), setups, jobs=a.jobs, show_progress=not a.no_progress
            )
        else:
            result = evaluate(spec, jobs=a.jobs, show_progress=not a.no_progress)
    except (ValueError, OSError, SimError) as e:
        print(f"kvrouter eval: {e}", file=sys.stderr)
        return 2
    print(pd_table(result) if a.roles else table(result))
    if a.json_out:
        with open(a.json_out, "wb") as f:
            f.write(msgspec.json.format(msgspec.json.encode(result), indent=1))
    if a.csv_out and not a.roles:
        with open(a.csv_out, "w") as f:
            f.write(to_csv(result))
    return 0


def _tier_grid(a: argparse.Namespace) -> int:
    from kvrouter.lab.report.grid import run_grid
    from kvrouter.lab.report.tiers import TierSizes, hyperpod_table, tier_cases, tier_table

    try:
        spec = spec_from_args(a)
        if not (a.cpu_offload_blocks and a.l2_blocks):
            raise ValueError("--tier-grid needs --cpu-offload-blocks and --l2-blocks")
        sizes = TierSizes(a.capacity_blocks, a.cpu_offload_blocks, a.l2_blocks, a.l2_gbps)
        rates = [float(x) for x in a.rates.split(",") if x]
        cases = tier_cases(spec, sizes, rates)

        def progress(done: int, total: int) -> None:
            if not a.no_progress:
                print(f"\r{done}/{total} runs", end="", file=sys.stderr, flush=True)

        results = run_grid(cases, jobs=a.jobs, progress=progress)
    except (ValueError, OSError) as e:
        print(f"kvrouter eval: {e}", file=sys.stderr)
        return 2
    if not a.no_progress:
        print(file=sys.stderr)
    print(tier_table(results))
    print()
    print(hyperpod_table(results))
    if a.json_out:
        with open(a.json_out, "wb") as f:
            f.write(msgspec.json.format(msgspec.json.encode(results), indent=1))
    return 0


def _flows(a: argparse.Namespace) -> int:
    try:
        spec = FlowsSpec(
            loads=tuple(float(x) for x in a.loads.split(",") if x),
            duration_s=a.duration,
            interactive_rate=a.interactive_rate,
            batch_rate=a.batch_rate,
            instances=a.flows_instances,
            profile=_profile(a),
            max_in_flight=a.flows_max_in_flight,
            max_prefill_tokens=a.flows_max_prefill_tokens,
            reserve=a.flows_reserve,
            quiet_share=a.flows_quiet_share,
            seed=a.seed,
        )
        report = evaluate_flows(
            spec,
            jobs=a.jobs,
            progress=None if a.no_progress else lambda m: print(m, file=sys.stderr, flush=True),
        )
    except (ValueError, OSError) as e:
        print(f"kvrouter eval: {e}", file=sys.stderr)
        return 2
    print(flows_table(report))
    if a.json_out:
        with open(a.json_out, "wb") as f:
            f.write(msgspec.json.format(msgspec.json.encode(report), indent=1))
    return 0
