"""Notebook 3: where kv-aware wins, where prefix-hash is enough, where neither helps.

One parameter at a time around a base case, every other setting as in the base:

=================  ====================================================  ================================
sweep              values                                                workload
=================  ====================================================  ================================
instances          2, 4, 8, 16 (offered load per instance kept)          Mooncake conversation, 800 req.
capacity_blocks    20k .. 166k (the profile's: 82,855 = 1.33 M tokens)    same, with the pooled-cache bound
load               1x .. 4x the trace's recorded rate                     same
event_delay_s      5 ms .. 30 s (kv-aware only: nothing else reads it)   same
event_loss         0 .. 10 % of event batches, no replay (kv-aware)      same
prefix length      512 .. 32k tokens of shared prefix                    64 groups, fresh questions
=================  ====================================================  ================================

The base is the first 800 requests of the Mooncake conversation trace at 3x its recorded rate on 8
instances (the load at which kv-aware's weights were tuned): real arrival bursts and multi-turn reuse, and
small enough for ~60 runs in about five minutes.  Least-loaded is the cache-blind reference: where it
matches the others, neither cache-aware policy helps.
"""

from __future__ import annotations

from kvrouter.lab.evaluation.compare import EvalSpec
from kvrouter.lab.evaluation.virtual_fleet import FleetSimConfig
from kvrouter.lab.report.grid import Case, with_param, with_rate
from kvrouter.lab.report.scale import Scale
from kvrouter.lab.report.study import Study
from kvrouter.lab.sim.engine.timing import get_profile
from kvrouter.routing import KV_AWARE, LEAST_LOADED, PREFIX_HASH

POLICIES = (KV_AWARE, PREFIX_HASH, LEAST_LOADED)
BASE = EvalSpec(
    workload="mooncake-conversation",
    overrides={"limit": 800, "rate_multiplier": 3.0},
    fleet=FleetSimConfig(instances=8),
    policies=POLICIES,
)
INSTANCES = (2, 4, 8, 16)
CAPACITY_BLOCKS = (20_000, 40_000, None, 165_710)
"""None: the profile's 82,855 blocks; the last doubles it (as a CPU tier would, without its copy cost).
Below ~20k blocks the requests running at this load no longer fit and the sweep measures batch
starvation (mean TTFT of tens of seconds), not caching."""
RATES = (1.0, 2.0, 3.0, 4.0)
"""Multiples of the trace's recorded rate."""
EVENT_DELAYS_S = (0.005, 0.5, 5.0, 30.0)
"""Up to beyond the indexer's speculative-entry lifetime (5 s): the router's own guesses expire first."""
EVENT_LOSSES = (0.0, 0.001, 0.01, 0.1)
PREFIX_TOKENS = (512, 2048, 8000, 32000)
PREFIX_BASE = EvalSpec(
    workload="aws-8k-shared-prefix",
    overrides={"num_groups": 64, "num_requests": 1000, "arrival": {"type": "poisson", "rate": 4.0}},
    fleet=FleetSimConfig(instances=8),
    policies=POLICIES,
)
"""64 shared prefixes, fresh 100..300-token questions, 4 requests/s (least-loaded's prefill at 32k-token
prefixes stays within the fleet's compute)."""


def _case(label: str, spec: EvalSpec, x: float | int, *, bounds: bool = False) -> Case:
    return Case(f"{label}={x}", spec, x, bounds)


def instances_study(scale: Scale, base: EvalSpec) -> Study:
    n0 = base.fleet.instances
    cases = [
        _case("instances", with_rate(with_param(base, "fleet.instances", n), n / n0), n)
        for n in scale.values(INSTANCES)
    ]
    return Study(
        "instances", "instances (rate scaled with the fleet)", cases, x_label="instances", log_x=True
    )


def capacity_study(scale: Scale, base: EvalSpec) -> Study:
    full = get_profile(base.fleet.profile).kv_capacity_blocks(base.fleet.block_size)
    cases = []
    for c in scale.values(CAPACITY_BLOCKS):
        blocks = full if c is None else c
        cases.append(
            _case("capacity_blocks", with_param(base, "fleet.capacity_blocks", blocks), blocks, bounds=True)
        )
    title = "KV capacity per instance (blocks of 16 tokens)"
    return Study("capacity", title, cases, x_label="capacity_blocks", log_x=True)


def load_study(scale: Scale, base: EvalSpec) -> Study:
    cases = [_case("rate", with_param(base, "overrides.rate_multiplier", m), m) for m in scale.values(RATES)]
    return Study("load", "load (multiple of the trace's recorded rate)", cases, x_label="rate multiplier")


def event_studies(scale: Scale, base: EvalSpec) -> list[Study]:
    kv = with_param(base, "policies", (KV_AWARE,))
    ref = Case(
        "reference",
        with_param(base, "policies", (PREFIX_HASH, LEAST_LOADED)),
        bounds=False,
    )
    delay = [
        _case("event_delay_s", with_param(kv, "fleet.event_delay_s", d), d)
        for d in scale.values(EVENT_DELAYS_S)
    ]
    loss = [_case("event_loss", with_param(kv, "fleet.event_loss", v), v) for v in scale.values(EVENT_LOSSES)]
    return [
        Study("event_delay", "KV event delivery delay (s)", delay, ref, "event_delay_s", log_x=True),
        Study(
            "event_loss", "fraction of KV event batches lost (no replay)", loss, ref, "event_loss", log_x=True
        ),
    ]


def prefix_study(scale: Scale) -> Study:
    base = scale.size(PREFIX_BASE)
    if scale.fraction != 1.0:  # keep requests per prefix when the request count shrinks
        groups = max(2, round(64 * scale.fraction))
        base = with_param(base, "overrides.num_groups", groups)
    cases = [
        _case("system_len", with_param(base, "overrides.system_len", t), t)
        for t in scale.values(PREFIX_TOKENS)
    ]
    title = "shared prefix length (tokens), 64 prefixes"
    return Study("prefix", title, cases, x_label="shared prefix tokens", log_x=True)


def studies(scale: Scale) -> list[Study]:
    """Every sweep of the notebook, at ``scale``."""
    base = scale.size(BASE)
    return [
        instances_study(scale, base),
        capacity_study(scale, base),
        load_study(scale, base),
        *event_studies(scale, base),
        prefix_study(scale),
    ]
