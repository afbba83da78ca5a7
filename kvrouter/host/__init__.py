"""The worker processes of one host (``kvrouter serve --workers N``) and the state they share in one
block of shared memory, which keeps N processes routing as one::

    memory.py     HostLayout, HostMemory (typed views over the shared buffer), SlotDirectory (names -> slots)
    loads.py      HostLoads: per-worker load rows, engine and external load  (routing.LoadTracker's seam)
    health.py     HealthBoard: health and ejections                          (gateway.UpstreamPool's)
    queue.py      QueueBoard: the limits' queue and the held-requests bound  (pipeline.CapacityGate's)
    flows.py      HostFlows: the flows' accounts, backlogs and rate buckets  (flows.FlowQueue's, too)
    spec_ring.py  SpeculativeRings: speculative entries and placements, a ring per worker (Router's HostSync)
    claims.py     HostClaims: new prompts' targets claimed among the workers (pipeline.PlacementClaims)
    metrics_board.py, metric_merge.py   each worker's last metrics snapshot; the host's one /metrics
    supervisor.py Supervisor, shared_host, preload: fork N workers, replace the dead, stop on signals
    wiring.py     WorkerHost (a worker's share of the host, for Gateway), RingSync; scrape.py: HostScrape

The boards are pure (numpy views over a buffer the caller made, a lock the caller passes); ``supervisor``
makes the shared mapping and the processes.  Import it and ``wiring`` by module: this package loads neither.
"""

from .flows import HostFlows
from .health import HealthBoard
from .loads import HostLoads
from .memory import HostLayout, HostLock, HostMemory, SlotDirectory, SlotsExhausted
from .metrics_board import MetricsBoard, SnapshotTooLarge
from .queue import QueueBoard
from .spec_ring import PeerEntry, SpeculativeRings

__all__ = [
    "HealthBoard",
    "HostFlows",
    "HostLayout",
    "HostLoads",
    "HostLock",
    "HostMemory",
    "MetricsBoard",
    "PeerEntry",
    "QueueBoard",
    "SlotDirectory",
    "SlotsExhausted",
    "SnapshotTooLarge",
    "SpeculativeRings",
]
