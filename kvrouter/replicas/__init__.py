"""Router replicas that agree: shared in-flight load and speculative entries, and warm restarts.

::

    replica 1 ─┐  every interval_s (50 ms), one round trip (Lua):      ┌─ LoadTracker.external_in_flight
    replica 2 ─┼─ publish own lease (load) + new speculative entries ──┤
    replica N ─┘  read peers' leases + peers' entries since cursor ────┴─ index speculative layer

Every replica subscribes to every instance's KV events itself (ZeroMQ PUB/SUB), so the block index
needs no shared store on the hot path; what only routers know (in flight per target, speculative entries
for requests just sent) goes through Redis as expiring leases.  The request path waits for Redis only to
place a prompt that no target holds (``claims``: one call, two when other new prompts were placed since,
bounded by ``timeout_s``, skipped while Redis fails), where the prefill that follows costs far more
than the call.

``config``    ``SharedStateConfig`` (one struct, validated once)
``state``     ``ReplicaState``: the pure half (what to publish, how to take peers' state in)
``store``     ``ReplicaStore`` seam: ``RedisReplicaStore`` (Lua) and ``MemoryReplicaHub`` (virtual time)
``shared``    ``SharedState``: the asyncio loop, failure counting, resynchronisation
``claims``    ``PrefixClaims``: the first replica to place a new prompt claims where; the others follow;
              a claim is taken only knowing of every new placement before it
``warm``      ``WarmRestart``: periodic index snapshots to a file or Redis, restore at start
"""

from .claims import PrefixClaims
from .config import SharedStateConfig, SnapshotConfig
from .shared import SharedState
from .state import ReplicaState, SyncReply, SyncRequest
from .store import MemoryReplicaHub, RedisReplicaStore, ReplicaStore
from .warm import WarmRestart, mark_restored, store_for

__all__ = [
    "MemoryReplicaHub",
    "PrefixClaims",
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
