"""What one router replica shares and takes in, as pure values: no I/O, no clock (``now`` comes in).

::

    Router.load, Indexer.speculative_outbox, ResponseAffinity.outbox ── request(now) ─▶ SyncRequest ─▶ store
    LoadTracker.set_external (sum of peers)   ◀─┬─ apply(reply, now) ◀─ SyncReply ◀─ (one round trip)
    BlockIndex.add_speculative (peer entries) ◀─┤   (with what is left of each entry's TTL)
    Router.peer_prefill, Router.host.peers    ◀─┤   (peer entries: queued prefill; the host's workers)
    ResponseAffinity.learned (response ids)   ◀─┘

Invariants: an entry whose blocks were stored (or stored and evicted, or expired) before it could be
published is not published; peer entries go straight into the index, never through
``Indexer.add_speculative``, so they are never published again (no echo); a batch's entries carry the TTL
left when published and a reader ages them on the store's clock, never comparing two hosts' clocks.  The
hot path never waits for this.  Wire format and reasons: docs/replicas.md.
"""

from __future__ import annotations

import msgspec
import numpy as np

from indexer import SourceKey
from indexer.index import SPECULATIVE_BIT, STORED_BITS, SourceMatch
from indexer.indexer import SpeculativeEntry

from ..routing import Router
from ..routing.peer_prefill import PeerPrefill
from ..routing.response_affinity import ResponseAffinity, SharedHolder
from ..types import TargetKey
from .flows import ReplicaFlows


class SpecWire(msgspec.Struct, array_like=True, gc=False):
    """One speculative entry as published: chains are int64 little-endian."""

    instance: str
    dp_rank: int
    chains: bytes
    ttl_left_ms: int


class Batch(msgspec.Struct, omit_defaults=True):
    """What one replica publishes in one round trip."""

    s: list[SpecWire] = []
    """Speculative entries."""
    a: list[SharedHolder] = []
    """Response ids this replica saw produced, with their instance."""


LoadReport = dict[str, tuple[int, int]]
"""target -> (requests in flight, prompt tokens still to prefill), this replica's own."""


class SyncRequest(msgspec.Struct, frozen=True):
    replica: str
    lease_ms: int
    loads: bytes
    """msgpack ``LoadReport``."""
    specs: bytes
    """msgpack ``list[SpecWire]``; empty when there is nothing new."""
    cursor: str
    """Last speculative batch id read; "" reads the whole window (start, or after an outage)."""
    window_ms: int
    max_read: int
    queue: bytes = b""
    """msgpack ``replicas.flows.QueueWire``: this replica's waiters (empty: none)."""
    counts: list[tuple[str, float]] = []
    """This replica's running totals that changed since last published (``replicas.flows``)."""
    totals_since: str = ""
    """The ``SyncReply.totals_at`` of the last reply read: only the service totals changed since are
    wanted ("" or another store's: every one)."""


class SyncReply(msgspec.Struct, frozen=True):
    server_ms: int
    """The store's clock when it answered."""
    cursor: str
    peer_loads: list[bytes]
    """Each live peer's ``LoadReport`` (expired leases are not here)."""
    peer_specs: list[tuple[int, bytes]]
    """(the store's time when published, ms; msgpack ``list[SpecWire]``) of peers' batches since cursor."""
    peer_queues: list[tuple[int, bytes]] = []
    """(the store's time when published, ms; msgpack ``QueueWire``) of each live peer with waiters."""
    totals: dict[str, float] = {}
    """Service totals summed over every replica that ever published one (this one included): every one
    when ``totals_full``, else those changed since the request's ``totals_since``."""
    peer_use: dict[str, dict[str, float]] = {}
    """Every live peer's rate use as it last published it (by replica; empty: none yet)."""
    totals_at: str = ""
    """Where the store's totals stand ("<epoch>:<version>"): the next request's ``totals_since``."""
    totals_full: bool = True


_ENC = msgspec.msgpack.Encoder()
_LOADS = msgspec.msgpack.Decoder(LoadReport)
_SPECS = msgspec.msgpack.Decoder(list[SpecWire])
_BATCH = msgspec.msgpack.Decoder(Batch)


def decode_batch(raw: bytes) -> Batch:
    """A peer's batch (raises ``msgspec.DecodeError`` when it is neither shape)."""
    try:
        return _BATCH.decode(raw)
    except msgspec.DecodeError:
        return Batch(s=_SPECS.decode(raw))


def _stored(matches: list[SourceMatch], src: SourceKey) -> int:
    """Leading blocks ``src`` holds for real (events arrived): a peer's entry for them is dropped, as it
    would outlive their eviction here.  The peer's request was sent before those events reached it."""
    for m in matches:
        if m.source == src:
            return m.gpu + m.cpu + m.storage
    return 0


class ReplicaState:
    """The pure half of shared router state for one replica (owned by the event loop's thread)."""

    def __init__(
        self,
        router: Router,
        replica: str,
        *,
        speculative: bool = True,
        max_unsent: int = 20_000,
        affinity: ResponseAffinity | None = None,
        flows: ReplicaFlows | None = None,
    ) -> None:
        self.router = router
        self.replica = replica
        self.flows = flows
        """The queue, flow accounts and rate limits shared with the peers (None: this replica's own)."""
        self.speculative = speculative
        self.max_unsent = max_unsent
        self.affinity = affinity
        self.cursor = ""
        self.unsent: list[SpeculativeEntry] = []
        self.unsent_affinity: list[SharedHolder] = []
        self.applied_affinity = 0
        self.peers = 0
        self.applied_entries = 0
        self.decode_errors = 0
        self.dropped_entries = 0
        self.done_unsent = 0
        """Own entries not published: their blocks were stored (or their entry gone) by then."""
        # The router's own when it was built with one (the gateway's wiring), so its workers' ring counts
        # into the same place.
        self.peer_prefill = (
            (router.peer_prefill or PeerPrefill(router.indexer.block_size)) if speculative else None
        )
        if self.peer_prefill is not None:
            router.peer_prefill = self.peer_prefill

    # ------------------------------------------------------------------ outgoing
    def take_outbox(self, now: float) -> None:
        """Move what the router sent since the last call into ``unsent`` (kept until published)."""
        box = self.router.indexer.speculative_outbox
        if box:
            self.unsent.extend(box)
            box.clear()
        ttl = self.router.indexer.speculative_ttl
        keep = [e for e in self.unsent if e.now + ttl > now][-self.max_unsent :] if self.unsent else []
        self.dropped_entries += len(self.unsent) - len(keep)
        self.unsent = keep
        if self.affinity is not None:
            self.unsent_affinity.extend(self.affinity.take_outbox(now))
            self.unsent_affinity = self.unsent_affinity[-self.max_unsent :]

    def _pending(self) -> list[SpeculativeEntry]:
        """The unsent entries whose blocks this replica's index still counts on the entry alone.  One
        whose last block is stored (the request computed them all: the peers see the same events) or
        gone (stored and evicted since, or expired) would only claim blocks the target may no longer
        hold, for as long as its TTL, in every peer."""
        out: list[SpeculativeEntry] = []
        ix = self.router.indexer
        for e in self.unsent:
            held = ix.holding(e.source, e.chains[-1:])
            if held is None or (held[0] & SPECULATIVE_BIT and not held[0] & STORED_BITS):
                out.append(e)
        self.done_unsent += len(self.unsent) - len(out)
        return out

    def request(self, now: float, *, lease_s: float, window_s: float, max_read: int) -> SyncRequest:
        if self.router.host is not None:
            # Several workers (``kvrouter.host``): the other workers' entries reach this one's outbox
            # when it takes them in, which it otherwise does only before a decision of its own.
            self.router.host.pull()
        self.take_outbox(now)
        self.unsent = self._pending()
        if self.router.load.shared is not None:
            self.router.load.refresh()  # the whole host's requests, as of now, not of its last decision
        loads: LoadReport = {
            str(inst): (load.in_flight, load.pending_prefill_tokens)
            for inst, load in self.router.load.loads.items()
            if load.in_flight > 0
        }
        ttl = self.router.indexer.speculative_ttl
        specs = [
            SpecWire(
                e.source.instance,
                e.source.dp_rank,
                np.ascontiguousarray(e.chains, dtype="<i8").tobytes(),
                int((e.now + ttl - now) * 1000),
            )
            for e in self.unsent
        ]
        batch = Batch(s=specs, a=list(self.unsent_affinity))
        queue, counts = self.flows.request() if self.flows is not None else (b"", [])
        return SyncRequest(
            self.replica,
            int(lease_s * 1000),
            _ENC.encode(loads),
            _ENC.encode(batch) if specs or batch.a else b"",
            self.cursor,
            int(window_s * 1000),
            max_read,
            queue,
            counts,
            self.flows.since if self.flows is not None else "",
        )

    def published(self) -> None:
        """The last request reached the store: its entries need not be sent again."""
        self.unsent = []
        self.unsent_affinity = []
        if self.flows is not None:
            self.flows.published()

    # ------------------------------------------------------------------ incoming
    def apply(self, reply: SyncReply, now: float) -> None:
        """Peers' load replaces the previous view; peers' new speculative entries join the index; their
        waiters, service and rate use join this replica's queue (``flows``), last: it wakes the queue, which
        must see the peers' load as of this reply."""
        totals: dict[TargetKey, tuple[int, int]] = {}
        self.peers = len(reply.peer_loads)
        for raw in reply.peer_loads:
            try:
                report = _LOADS.decode(raw)
            except msgspec.DecodeError:
                self.decode_errors += 1
                continue
            for target, (n, tokens) in report.items():
                cur = totals.get(TargetKey(target), (0, 0))
                totals[TargetKey(target)] = (cur[0] + n, cur[1] + tokens)
        self.router.load.set_external(totals)
        self.cursor = reply.cursor
        index = self.router.indexer.index
        ttl = self.router.indexer.speculative_ttl
        taken: list[SpeculativeEntry] = []
        for published_ms, raw in reply.peer_specs:
            try:
                batch = decode_batch(raw)
            except msgspec.DecodeError:
                self.decode_errors += 1
                continue
            age_ms = reply.server_ms - published_ms
            if self.affinity is not None:
                for h in batch.a:
                    left_ms = h.ttl_left_ms - age_ms
                    if left_ms > 0:
                        self.affinity.learned(msgspec.structs.replace(h, ttl_left_ms=left_ms), now)
                        self.applied_affinity += 1
            if not self.speculative:
                continue
            for e in batch.s:
                left = (e.ttl_left_ms - age_ms) / 1000
                if left <= 0 or not e.chains:
                    continue
                chains = np.frombuffer(e.chains, dtype="<i8").astype(np.int64)
                src = SourceKey(e.instance, e.dp_rank)
                chains = chains[_stored(index.match(chains), src) :]
                if len(chains):
                    index.add_speculative(src, chains, now=now, ttl=left)
                    if self.peer_prefill is not None:
                        self.peer_prefill.add(src, chains, expiry=now + left, now=now)
                    taken.append(SpeculativeEntry(src, chains, now + left - ttl))
                self.applied_entries += 1
        if taken and self.router.host is not None:
            self.router.host.peers(taken)
        if self.flows is not None:
            self.flows.apply(
                reply.peer_queues,
                reply.totals,
                reply.peer_use,
                now,
                totals_at=reply.totals_at,
                totals_full=reply.totals_full,
            )

    def forget_peers(self) -> None:
        """Peers' load is unknown (the store is unreachable past a lease): route on the local view."""
        self.router.load.set_external({})
        self.peers = 0
        if self.flows is not None:
            self.flows.forget_peers()
        if self.peer_prefill is not None:
            self.peer_prefill.clear()

    def resync(self) -> None:
        """Read the whole window again at the next round trip (after an outage or a store restart), and
        publish every running total again."""
        self.cursor = ""
        if self.flows is not None:
            self.flows.resync()
