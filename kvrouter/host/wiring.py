"""One worker's share of the host's shared state: what the seams of the pure code are built over.

::

    Gateway(cfg, host=WorkerHost(mem, k)) builds   LoadTracker(HostLoads)         (load, engine, external)
                                                   Router(host=RingSync)     (speculative entries, placements)
                                                   UpstreamPool(board=HealthBoard) (health, ejections)
                                                   RequestPipeline(host_queue=QueueBoard, held_host=...)
                                                     (the limits' queue; HostFlows: shares, rate limits;
                                                      claims=HostClaims without replicas)
                                                   host_scrape = HostScrape       (the host's /metrics)

Worker 0 is the leader: it alone scrapes engine load, runs the start-up fleet check, index snapshots and
the replicas' round trips to Redis (for the whole host's load and speculative entries).  What the round
trips bring in reaches every worker: other replicas' load through the shared external cells, their
speculative entries through the leader's ring (flagged as another replica's queued prefill).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from indexer import Indexer, SourceKey
from indexer.indexer import SpeculativeEntry

from ..routing.peer_prefill import PeerPrefill
from ..routing.placed_blocks import HostPlacement
from . import HealthBoard, HostLoads, HostMemory, MetricsBoard, QueueBoard, SpeculativeRings
from .claims import HostClaims
from .latency import HostLatency
from .scrape import HostScrape, WakePipes


class RingSync:
    """``routing.HostSync`` over the host's rings of speculative entries.

    This worker's entries reach the rings from ``Indexer.speculative_outbox``; with ``keep_outbox`` (the
    leader, when replicas share through Redis) the outbox is left for ``SharedState`` to publish, and the
    other workers' entries are added to it, so other hosts learn the whole host's entries."""

    def __init__(
        self,
        indexer: Indexer,
        rings: SpeculativeRings,
        *,
        keep_outbox: bool = False,
        peer_prefill: PeerPrefill | None = None,
    ) -> None:
        """``peer_prefill``: the worker's count of other replicas' queued prefill (``Router.peer_prefill``),
        fed with their entries as they arrive through the leader's ring."""
        self.indexer = indexer
        self.rings = rings
        self.keep_outbox = keep_outbox
        self.peer_prefill = peer_prefill
        self.from_replicas = 0
        """Other replicas' entries taken in through the rings (a worker that is not the leader)."""
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

    def pull(self) -> list[HostPlacement]:
        got = self.rings.pull()
        if not got:
            return []
        placed = [HostPlacement(e.source, e.placed, e.now) for e in got if e.placed]
        if placed:
            got = [e for e in got if not e.placed]
        index, ttl = self.indexer.index, self.indexer.speculative_ttl
        for e in got:
            # Straight into the index (not Indexer.add_speculative): an entry is shared once, by its origin.
            index.add_speculative(e.source, e.chains, now=e.now, ttl=ttl)
            if e.from_replica:
                self.from_replicas += 1
                if self.peer_prefill is not None:
                    self.peer_prefill.add(e.source, e.chains, expiry=e.now + ttl, now=e.now)
        if self.keep_outbox:
            self.push()
            box = self.indexer.speculative_outbox
            assert box is not None
            # this host's entries only: another replica's went round already
            box.extend(SpeculativeEntry(e.source, e.chains, e.now) for e in got if not e.from_replica)
            self._pos = len(box)
        return placed

    def placed(self, source: SourceKey, blocks: int, now: float) -> None:
        self.rings.push_placed(source, blocks, now)

    def peers(self, entries: list[SpeculativeEntry]) -> None:
        self.rings.push(entries, from_replica=True)


class WorkerHost:
    """Worker ``me`` of the host whose shared memory is ``mem``: passed to ``Gateway(host=...)``, which
    builds its parts over it (``gateway.app.WorkerShare``)."""

    def __init__(self, mem: HostMemory, me: int, pipes: WakePipes | None = None) -> None:
        self.mem = mem
        self.me = me
        self.pipes = pipes
        """Every worker's wake pipe (made before the fork); None: this host's /metrics is per worker."""
        self.loads = HostLoads(mem, me)
        self.health = HealthBoard(mem)
        self.queue = QueueBoard(mem, me)
        self.latency = HostLatency(mem)
        self.rings = SpeculativeRings(mem, me)
        self.sync: RingSync | None = None
        self.claims: HostClaims | None = None

    @property
    def leader(self) -> bool:
        return self.me == 0

    @property
    def workers(self) -> int:
        return self.mem.layout.workers

    def ring_sync(
        self, indexer: Indexer, *, keep_outbox: bool, peer_prefill: PeerPrefill | None = None
    ) -> RingSync:
        """The router's exchange of speculative entries with the other workers, over ``indexer``;
        ``peer_prefill``: where other replicas' entries reaching this worker through the leader count."""
        self.sync = RingSync(indexer, self.rings, keep_outbox=keep_outbox, peer_prefill=peer_prefill)
        return self.sync

    def placement_claims(self, ttl_s: float, registry: CollectorRegistry | None = None) -> HostClaims:
        """The workers' claims of new prompts' targets, each living ``ttl_s`` (a speculative entry's TTL);
        counted in ``registry``."""
        self.claims = HostClaims(self.mem, ttl_s, registry=registry)
        return self.claims

    def scrape(
        self, collect: Callable[[], Iterable[Metric]], refresh: Callable[[], None]
    ) -> HostScrape | None:
        """The host's /metrics over every worker, from this worker's ``collect`` (None without wake pipes:
        each worker answers with its own registry)."""
        if self.pipes is None:
            return None
        return HostScrape(MetricsBoard(self.mem, self.me), self.pipes, collect, refresh=refresh)

    def state(self) -> dict[str, object]:
        """For /health: this worker, what it lost of the others' speculative entries, the host's limits
        queue (every worker's rows: the same answer from any worker), and how many other replicas' entries
        reached it through the leader."""
        out: dict[str, object] = {
            "worker": self.me,
            "workers": self.workers,
            "speculative_lost": self.rings.lost,
            "queue": {"waiting": self.queue.waiting_total(), "held": self.queue.held_total()},
        }
        if self.sync is not None:
            out["replica_entries_via_leader"] = self.sync.from_replicas
        if self.claims is not None:
            out["claims"] = dict(self.claims.outcomes)
        return out
