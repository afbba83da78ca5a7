"""Routing: pure policies and load accounting, shared by the live gateway and the simulator.

Nothing here does I/O or reads a clock: callers pass ``now`` and observations in, and get decisions out.
"""

from .load import InstanceLoad, LoadTracker
from .policies import POLICIES, Policy, make_policy
from .router import Candidate, Decision, RouteInput, Router, RouterConfig
from .types import InstanceId, RequestId

__all__ = [
    "POLICIES",
    "Candidate",
    "Decision",
    "InstanceId",
    "InstanceLoad",
    "LoadTracker",
    "Policy",
    "RequestId",
    "RouteInput",
    "Router",
    "RouterConfig",
    "make_policy",
]
