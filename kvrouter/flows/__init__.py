"""When and for whom: flows (a tenant at a priority), the queue that serves them by priority and fair
share, and per-tenant rate limits.  Pure; the request path (``kvrouter.pipeline``) and the evaluator use
the same classes.

::

    config.py     FlowsConfig, TenantFlow: the fleet file's ``flows:`` section
    identity.py   identify: a request's flow from its API key's tenant and its headers
    scheduler.py  FlowQueue: priority first, then the least-served flow; sheds lowest first
    rate.py       RateLimiter: requests and tokens per minute per tenant
    meter.py      WorkMeter: each flow's recent work, and whether it is heavy (``routing.isolation``)
    slo.py        read_objective, predict, best, miss: TTFT/TPOT objectives checked before waiting
    board.py      ProcessBoard: one process's queue board, shared with other router replicas only
"""

from .board import LocalFlows, ProcessBoard
from .config import DEFAULT_MAX_FLOWS, FAIRNESS, Fairness, FlowsConfig, TenantFlow
from .identity import identify
from .meter import WorkMeter
from .rate import Buckets, BucketStore, LocalBuckets, RateLimiter
from .scheduler import (
    Flow,
    FlowAccounts,
    FlowQueue,
    LocalAccounts,
    Refused,
    Waiter,
    request_cost,
)
from .slo import Objective, SloConfig, TargetView, best, miss, predict, read_objective

__all__ = [
    "DEFAULT_MAX_FLOWS",
    "FAIRNESS",
    "BucketStore",
    "Buckets",
    "Fairness",
    "Flow",
    "FlowAccounts",
    "FlowQueue",
    "FlowsConfig",
    "LocalAccounts",
    "LocalBuckets",
    "LocalFlows",
    "Objective",
    "ProcessBoard",
    "RateLimiter",
    "Refused",
    "SloConfig",
    "TargetView",
    "TenantFlow",
    "Waiter",
    "WorkMeter",
    "best",
    "identify",
    "miss",
    "predict",
    "read_objective",
    "request_cost",
]
