"""Routing: pure policies and load accounting, shared by the live gateway and the simulator.

Nothing here does I/O or reads a clock: callers pass ``now`` and observations in, and get decisions out.
"""

from .disagg import DisaggMode, DisaggPlanner, DisaggSettings, PDPlan, is_disaggregated
from .load import InstanceLoad, LoadTracker
from .policies import (
    ALL_POLICIES,
    KV_AWARE,
    LEAST_LOADED,
    PREFIX_HASH,
    RANDOM,
    READS_INDEX,
    ROUND_ROBIN,
    SESSION,
    Policy,
    PolicyConfig,
    PolicySettings,
    make_policy,
    policy_name,
)
from .router import Candidate, Decision, RouteInput, Router, RouterConfig, Target, route_input

__all__ = [
    "ALL_POLICIES",
    "KV_AWARE",
    "LEAST_LOADED",
    "PREFIX_HASH",
    "RANDOM",
    "READS_INDEX",
    "ROUND_ROBIN",
    "SESSION",
    "Candidate",
    "Decision",
    "DisaggMode",
    "DisaggPlanner",
    "DisaggSettings",
    "InstanceLoad",
    "LoadTracker",
    "PDPlan",
    "Policy",
    "PolicyConfig",
    "PolicySettings",
    "RouteInput",
    "Router",
    "RouterConfig",
    "Target",
    "is_disaggregated",
    "make_policy",
    "policy_name",
    "route_input",
]
