"""One worker's attachment to the host's shared state: the seams of the pure code, filled.

::

    WorkerHost(mem, k) ──attach(gateway)──▶ router.load.shared   = HostLoads      (load, engine, external)
                                            router.host          = RingSync       (speculative entries)
                                            pool.board           = HealthBoard    (health, ejections)
                                            pipeline.gate.shared = QueueBoard     (the limits' queue)
                                            pipeline.admission.held_host = QueueBoard  (max_requests)
                                            host_scrape          = HostScrape     (the host's /metrics)

Worker 0 is the leader: it alone scrapes engine load (the others read it from the shared loads), runs the
start-up fleet check, index snapshots and the replicas' round trips to Redis, which publish the
whole host's load and speculative entries.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from indexer import Indexer
from indexer.indexer import SpeculativeEntry

from ..host import HealthBoard, HostLoads, HostMemory, MetricsBoard, QueueBoard, SpeculativeRings
from .scrape import HostScrape, WakePipes

if TYPE_CHECKING:
    from ..gateway import Gateway


class RingSync:
    """``routing.HostSync`` over the host's rings of speculative entries.

    This worker's entries reach the rings from ``Indexer.speculative_outbox``; with ``keep_outbox`` (the
    leader, when replicas share through Redis) the outbox is left for ``SharedState`` to publish, and the
    other workers' entries are added to it, so other hosts learn the whole host's entries."""

    def __init__(self, indexer: Indexer, rings: SpeculativeRings, *, keep_outbox: bool = False) -> None:
        self.indexer = indexer
        self.rings = rings
        self.keep_outbox = keep_outbox
        self._pos = 0
        if indexer.speculative_outbox is None:
            indexer.speculative_outbox = []

    def push(self) -> None:
        box = self.indexer.speculative_outbox
        if box is None:  # a shell stopped sharing (replicas' stop): start again
            box = self.indexer.speculative_outbox = []
            self._pos = 0
        if len(box) < self._pos:
            self._pos = 0  # the replicas' shell took what was there
        if len(box) > self._pos:
            self.rings.push(box[self._pos :])
        if self.keep_outbox:
            self._pos = len(box)
        else:
            box.clear()
            self._pos = 0

    def pull(self) -> None:
        got = self.rings.pull()
        if not got:
            return
        index, ttl = self.indexer.index, self.indexer.speculative_ttl
        for e in got:
            # Straight into the index (not Indexer.add_speculative): an entry is shared once, by its origin.
            index.add_speculative(e.source, e.chains, now=e.now, ttl=ttl)
        if self.keep_outbox:
            self.push()
            box = self.indexer.speculative_outbox
            assert box is not None
            box.extend(SpeculativeEntry(e.source, e.chains, e.now) for e in got)
            self._pos = len(box)


class WorkerHost:
    """Worker ``me`` of the host whose shared memory is ``mem``."""

    def __init__(self, mem: HostMemory, me: int, pipes: WakePipes | None = None) -> None:
        self.mem = mem
        self.me = me
        self.pipes = pipes
        """Every worker's wake pipe (made before the fork); None: this host's /metrics is per worker."""
        self.loads = HostLoads(mem, me)
        self.health = HealthBoard(mem)
        self.queue = QueueBoard(mem, me)
        self.rings = SpeculativeRings(mem, me)
        self.sync: RingSync | None = None

    @property
    def leader(self) -> bool:
        return self.me == 0

    @property
    def workers(self) -> int:
        return self.mem.layout.workers

    def attach(self, gw: Gateway) -> None:
        """Point the gateway's pure parts at the host's shared state (before it starts)."""
        gw.router.load.shared = self.loads
        self.sync = RingSync(gw.indexer, self.rings, keep_outbox=self.leader and gw.shared is not None)
        gw.router.host = self.sync
        gw.pool.board = self.health
        gw.pool.scrape_engines = self.leader
        gw.pipeline.gate.shared = self.queue
        gw.pipeline.admission.held_host = self.queue
        gw.pipeline.id_prefix = f"w{self.me}-r"
        gw.metrics.worker.labels(str(self.me)).set(1)
        gw.host_state = self.state
        if self.pipes is not None:
            gw.host_scrape = HostScrape(
                MetricsBoard(self.mem, self.me),
                self.pipes,
                gw.metrics.registry.collect,
                refresh=gw.refresh_gauges,
            )

    def state(self) -> dict[str, object]:
        """For /health: this worker, what it lost of the others' speculative entries, and the host's limits
        queue (every worker's rows: the same answer from any worker)."""
        return {
            "worker": self.me,
            "workers": self.workers,
            "speculative_lost": self.rings.lost,
            "queue": {"waiting": self.queue.waiting_total(), "held": self.queue.held_total()},
        }
