"""Router replicas that agree: shared in-flight load and speculative entries, and warm restarts.

Every ``interval_s``, each replica publishes its own lease (load) and new speculative entries and reads
its peers' leases and entries since its cursor, in one round trip (Lua), into
``LoadTracker.external_in_flight`` and the index's speculative layer.  Every replica subscribes to every
instance's KV events itself, so the block index needs no shared store; what only routers know goes
through Redis as expiring leases.  Invariant: the request path never waits for Redis.

``config``    ``SharedStateConfig`` (one struct, validated once)
``state``     ``ReplicaState``: the pure half (what to publish, how to take peers' state in)
``store``     ``ReplicaStore`` seam: ``RedisReplicaStore`` (Lua) and ``MemoryReplicaHub`` (virtual time)
``shared``    ``SharedState``: the asyncio loop, failure counting, resynchronisation
``warm``      ``WarmRestart``: periodic index snapshots to a file or Redis, restore at start
"""

from .config import SharedStateConfig, SnapshotConfig
from .shared import SharedState
from .state import ReplicaState, SyncReply, SyncRequest
from .store import MemoryReplicaHub, RedisReplicaStore, ReplicaStore
from .warm import WarmRestart, mark_restored, store_for

__all__ = [
    "MemoryReplicaHub",
    "RedisReplicaStore",
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
