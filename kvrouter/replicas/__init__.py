"""Router replicas that agree: shared in-flight load and speculative entries, and warm restarts.

::

    replica 1 ─┐  every interval_s, one round trip (Lua):               ┌─ LoadTracker.external_in_flight
    replica N ─┴─ publish own lease + new speculative entries; read peers' ┴─ index speculative layer

Every replica subscribes to every instance's KV events itself, so the block index needs no shared store;
what only routers know goes through Redis as expiring leases.  The request path waits for Redis only to
place a prompt no target holds (``claims``: one bounded call, two when other new prompts were placed
since, skipped while Redis fails).  Design notes: docs/replicas.md.

``config`` ``SharedStateConfig``; ``state`` ``ReplicaState`` (the pure half); ``flows`` ``ReplicaFlows``
(one queue, flow accounts and rate limits over the replicas); ``store`` the ``ReplicaStore`` seam
(``RedisReplicaStore``, ``MemoryReplicaHub``); ``shared`` ``SharedState`` (the asyncio shell); ``claims``
``PrefixClaims`` (new placements as one sequence); ``warm`` ``WarmRestart``.
"""

from .claims import PrefixClaims
from .config import SharedStateConfig, SnapshotConfig
from .flows import ReplicaFlows
from .shared import SharedState
from .state import ReplicaState, SyncReply, SyncRequest
from .store import MemoryReplicaHub, RedisReplicaStore, ReplicaStore
from .warm import WarmRestart, mark_restored, store_for

__all__ = [
    "MemoryReplicaHub",
    "PrefixClaims",
    "RedisReplicaStore",
    "ReplicaFlows",
    "ReplicaState",
    "ReplicaStore",
    "SharedState",
    "SharedStateConfig",
    "SnapshotConfig",
    "SyncReply",
    "SyncRequest",
    "WarmRestart",
    "mark_restored",
    "store_for",
]
