"""Routing policies, one module each, and their registry (``registry.PolicySettings``).  Each ranks the
candidate targets of one request; limits are applied by the router.

    kv-aware      cost of the prefill still to compute here, queued prefill and load  (``kv_aware``)
    prefix-hash   consistent hashing with bounded load over the prompt's opening    (``prefix_hash``)
    session       where the session's last request went, within limits; else kv-aware  (``session``)
    least-loaded  fewest requests in flight                                          (``least_loaded``)
    round-robin   in turn                                                            (``round_robin``)
    random        uniformly (seeded)                                                 (``random_order``)
    predicted-latency  lowest TTFT predicted by per-target models learned online     (``predicted_latency``,
                       the models: ``latency_model``)
"""

from .base import MIN_WEIGHT, Candidate, Policy, PolicyConfig, PolicyContext, RouteView, load_cap
from .kv_aware import KV_AWARE, RING_KEY_BLOCKS, KvAware, KvAwareSettings
from .latency_model import NOT_LEARNED, LatencyBook, LatencyModelConfig, ModelStore, Observation
from .least_loaded import LEAST_LOADED, LeastLoaded, LeastLoadedSettings
from .predicted_latency import PREDICTED_LATENCY, PredictedLatency, PredictedLatencySettings
from .prefix_hash import PREFIX_HASH, PrefixHash, PrefixHashSettings
from .random_order import RANDOM, Random, RandomSettings
from .registry import ALL_POLICIES, BUILT_IN, READS_INDEX, PolicySettings, make_policy, policy_name
from .round_robin import ROUND_ROBIN, RoundRobin, RoundRobinSettings
from .session import SESSION, SessionAffinity, SessionSettings, SessionTable

__all__ = [
    "ALL_POLICIES",
    "BUILT_IN",
    "KV_AWARE",
    "LEAST_LOADED",
    "MIN_WEIGHT",
    "NOT_LEARNED",
    "PREDICTED_LATENCY",
    "PREFIX_HASH",
    "RANDOM",
    "READS_INDEX",
    "RING_KEY_BLOCKS",
    "ROUND_ROBIN",
    "SESSION",
    "Candidate",
    "KvAware",
    "KvAwareSettings",
    "LatencyBook",
    "LatencyModelConfig",
    "LeastLoaded",
    "LeastLoadedSettings",
    "ModelStore",
    "Observation",
    "Policy",
    "PolicyConfig",
    "PolicyContext",
    "PolicySettings",
    "PredictedLatency",
    "PredictedLatencySettings",
    "PrefixHash",
    "PrefixHashSettings",
    "Random",
    "RandomSettings",
    "RoundRobin",
    "RoundRobinSettings",
    "RouteView",
    "SessionAffinity",
    "SessionSettings",
    "SessionTable",
    "load_cap",
    "make_policy",
    "policy_name",
]
