"""``kvrouter eval --roles 3P1D``: the same instances run aggregated, disaggregated and conditionally
disaggregated, with a kv-aware or a load-only prefill choice, on one workload::

    setup               roles            split                                   prefill instance
    aggregated          every one both   never (kv-aware over all instances)     -
    disaggregated       --roles          always                                  kv-aware on the prefill pool
    disaggregated-load  --roles          always                                  least-loaded
    conditional         --roles          routing.disagg's conditions             kv-aware
    conditional-load    --roles          routing.disagg's conditions             least-loaded
    predicted           --roles          the latency models (conditional: cold)  predicted-latency

Each setup is one ``run_one`` (the gateway's Router, Indexer and ``DisaggPlanner`` over the engine
model).  Beside TTFT and hit rates: inter-token latency (per request, its mean and its worst gap, a
decode stalled behind a prefill) and the share of requests within both objectives (``slo_attainment``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from kvrouter.lab.evaluation.compare import EvalSpec, load_workload, run_jobs
from kvrouter.routing import KV_AWARE, LEAST_LOADED, DisaggMode
from kvrouter.routing.disagg import roles_label
from kvrouter.routing.policies.predicted_latency import PREDICTED_LATENCY
from kvrouter.types import Role


class PDSetup(msgspec.Struct, frozen=True):
    name: str
    mode: DisaggMode
    """``off``: the instances serve whole requests (all ``both``)."""
    prefill_policy: str | None = None
    policy: str = KV_AWARE
    """The model's policy (the prefill pool's, unless ``prefill_policy``)."""


SETUPS: dict[str, PDSetup] = {
    s.name: s
    for s in (
        PDSetup("aggregated", DisaggMode.OFF),
        PDSetup("disaggregated", DisaggMode.ALWAYS),
        PDSetup("disaggregated-load", DisaggMode.ALWAYS, LEAST_LOADED),
        PDSetup("conditional", DisaggMode.CONDITIONAL),
        PDSetup("conditional-load", DisaggMode.CONDITIONAL, LEAST_LOADED),
        PDSetup("predicted", DisaggMode.PREDICTED, policy=PREDICTED_LATENCY),
    )
}
DEFAULT_SETUPS: tuple[str, ...] = tuple(s for s in SETUPS if s != "predicted")
"""``predicted`` (issue 33's split or whole by the latency models) runs when named in ``--setups``."""


def pd_spec(spec: EvalSpec, setup: str, roles: Sequence[Role]) -> EvalSpec:
    """``spec`` run as ``setup`` on instances with ``roles`` (aggregated: as many ``both`` instances)."""
    try:
        s = SETUPS[setup]
    except KeyError:
        raise ValueError(f"unknown setup {setup!r}; choose from {', '.join(SETUPS)}") from None
    fleet = msgspec.structs.replace(
        spec.fleet, instances=len(roles), roles=[] if s.mode == DisaggMode.OFF else list(roles)
    )
    disagg = msgspec.structs.replace(spec.disagg, mode=s.mode, prefill_policy=s.prefill_policy)
    return msgspec.structs.replace(spec, fleet=fleet, disagg=disagg, policies=(s.policy,))


def evaluate_pd(
    spec: EvalSpec,
    roles: Sequence[Role],
    setups: Sequence[str] = DEFAULT_SETUPS,
    *,
    jobs: int | None = None,
    show_progress: bool = True,
) -> dict[str, Any]:
    """Every setup's figures, keyed like ``evaluate``'s policies (so its tables read them)."""
    specs = {name: pd_spec(spec, name, roles) for name in setups}
    n = len(load_workload(spec).requests)
    results, _ = run_jobs(
        [(name, s, SETUPS[name].policy) for name, s in specs.items()],
        jobs=jobs,
        show_progress=show_progress,
        desc=f"eval {roles_label(roles)}",
        total=n * len(specs),
    )
    return {
        "workload": spec.workload or spec.trace,
        "requests": n,
        "roles": roles_label(roles),
        "fleet": msgspec.to_builtins(spec.fleet),
        "disaggregation": msgspec.to_builtins(spec.disagg),
        "slo": {"ttft_s": spec.slo_ttft_s, "tpot_s": spec.slo_tpot_s},
        "policies": {name: results[name] for name in setups},
    }


def pd_table(result: dict[str, Any]) -> str:
    """A plain-text table of ``evaluate_pd``'s result."""

    def ms(v: float) -> str:
        return f"{v * 1e3:.0f}ms" if v < 1 else f"{v:.2f}s"

    rows = [("setup", "SLO", "hit", "TTFT p50", "p90", "TPOT p50", "p90", "worst gap p90", "tok/s", "split")]
    for name, r in result["policies"].items():
        rows.append(
            (
                name,
                f"{r['slo_attainment']:.3f}",
                f"{r['hit_rate']:.3f}",
                ms(r["ttft_p50_s"]),
                ms(r["ttft_p90_s"]),
                ms(r["tpot_p50_s"]),
                ms(r["tpot_p90_s"]),
                ms(r["itl_max_p90_s"]),
                f"{r['throughput_tok_s']:.0f}",
                f"{r['split_fraction']:.2f}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    slo = result["slo"]
    lines.append(
        f"{result['workload']}, {result['requests']} requests, {result['roles']}; "
        f"SLO: TTFT <= {slo['ttft_s']} s and TPOT <= {slo['tpot_s'] * 1e3:.0f} ms"
    )
    return "\n".join(lines)
