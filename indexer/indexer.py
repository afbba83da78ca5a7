"""``Indexer``: the library API.  Decodes vLLM payloads, tracks sequences and trust, keeps the block index
and answers lookups.

::

    payload ──fast path (compiled: common shapes)─────────────────────────▶ BlockIndex
            └─BatchDecoder──▶ events ──EventApplier (``event_applier``)──▶ BlockIndex / shared stores
    (seq)   ──SourceSync────▶ apply | replay request | reset
    prompt  ──chain hashes──▶ BlockIndex.match ──▶ LookupResult (per source: blocks, tiers, trust)

Pure: no sockets, no clock (callers pass ``now``), counters are plain attributes the shells export.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import numpy.typing as npt

from . import fast_apply, fast_wire
from . import snapshot as _snapshot
from .answers import AnswerCache, InstanceMatch, LookupResult
from .errors import (
    DecodeError,
)
from .event_applier import Counters, EventApplier
from .fast_ingest import IngestScratch
from .hashing import (
    I64Array,
    TokenIds,
    base_hash,
    chained_hashes,
    request_chains,
    warmup,
)
from .index import BlockIndex, SourceMatch
from .sources import Action, Apply, Replay, Reset, SourceSync
from .store_writer import StoreWriter
from .tiers import SharedStoreConfig, SharedStores
from .types import Medium, SourceKey, Trust
from .wire import BatchDecoder, peek_ts

if TYPE_CHECKING:
    from .config import FleetConfig

_U64_MAX = (1 << 64) - 1
_NO_CHAINS: I64Array = np.zeros(0, dtype=np.int64)


class SpeculativeEntry(msgspec.Struct, gc=False):
    """A speculative entry this process added (``Indexer.speculative_outbox``), for a shell to share."""

    source: SourceKey
    chains: I64Array
    now: float


class Indexer:
    """The KV-cache state of a fleet, from vLLM's events.

    >>> ix = Indexer(block_size=16)
    >>> ix.apply_payload("vllm-0", payload)                   # one raw batch, any vLLM release
    >>> ix.lookup(token_ids, cache_salt="tenant-a").instances  # matched leading blocks per source
    """

    def __init__(
        self,
        block_size: int = 16,
        *,
        max_blocks_per_source: int = 8_000_000,
        speculative_ttl: float = 5.0,
        shared: list[SharedStoreConfig] | None = None,
        fast_ingest: bool = True,
    ) -> None:
        """``shared``: the fleet file's shared stores (``indexer.tiers``).
        ``fast_ingest``: payloads of the common shapes parsed and applied in compiled code
        (``indexer.fast_ingest``; only without shared stores: their routing of offload events is the
        reference path's alone); off, every payload takes the reference path (same results)."""
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.speculative_ttl = speculative_ttl
        warmup()
        self.index = BlockIndex(max_blocks_per_source=max_blocks_per_source)
        self.stores: StoreWriter | None = None
        if shared:
            self.stores = StoreWriter(self.index, SharedStores(shared))
        # The fast path never runs with shared stores (offload events may feed a store there, and stores
        # age per batch): every payload then takes the reference path.
        self._fast = IngestScratch(block_size) if fast_ingest and self.stores is None else None
        self.speculative_outbox: list[SpeculativeEntry] | None = None
        """When a list, every ``add_speculative`` is also appended here for a shell to deliver (shared
        router state); the shell drains it.  None (the default): nothing is kept."""
        self.counters = Counters()
        self._decoder = BatchDecoder()
        # Kept lookup answers depend on the known sources and their trust: _epoch changes with either.
        self._epoch = 0
        self._answers = AnswerCache(block_size)
        self._syncs: dict[SourceKey, SourceSync] = {}
        self._known: dict[SourceKey, None] = {}  # sources to report even with nothing cached
        self.block_size_mismatch: dict[SourceKey, int] = {}
        self.last_event_ts: dict[SourceKey, float] = {}
        self.applier = EventApplier(
            block_size, self.index, self.stores, self.counters, self.sync, self.block_size_mismatch
        )

    # ------------------------------------------------------------------ sources
    @classmethod
    def for_fleet(cls, fleet: FleetConfig, *, reserve: bool = True) -> Indexer:
        """The in-process index a fleet file describes: its block size, the indexer's options and shared
        stores, and (with ``reserve``, when ``indexer.reserve_blocks_per_source`` is set) tables sized for
        every listed (instance, rank).  ``reserve=False``: a router whose index holds only its speculative
        entries (the events are indexed elsewhere)."""
        o = fleet.indexer
        ix = cls(
            fleet.block_size,
            max_blocks_per_source=o.max_blocks_per_source,
            speculative_ttl=o.speculative_ttl_s,
            shared=fleet.tiers.shared,
        )
        if reserve and o.reserve_blocks_per_source:
            ix.reserve(sum(i.dp_size for i in fleet.instances), o.reserve_blocks_per_source)
        return ix

    def reserve(self, sources: int, blocks_per_source: int) -> None:
        """Size the tables ahead for a fleet of ``sources`` holding about ``blocks_per_source`` blocks each
        (their KV capacity): the in-process index then does not grow (each growth rehashes a whole table
        and holds the old and new arrays at once) until the fleet holds more."""
        if sources > 0 and blocks_per_source > 0:
            self.index.reserve(sources * blocks_per_source, per_source=blocks_per_source)

    def register(self, source: SourceKey, *, has_replay: bool = False) -> SourceSync:
        """Declare a publisher (from the fleet file) so it is reported, as cold, before it sends anything."""
        if source not in self._known:
            self._known[source] = None
            self._epoch += 1
            if self.stores is not None:
                self.index.slot_of(source)  # a slot now, so a store's blocks count for it before its own
        sync = self._syncs.get(source)
        if sync is None:
            sync = self._syncs[source] = self._new_sync(has_replay)
        else:
            sync.has_replay = has_replay
        return sync

    def _new_sync(self, has_replay: bool) -> SourceSync:
        sync = SourceSync(has_replay=has_replay)
        sync.on_trust_change = self._trust_changed
        self._epoch += 1
        return sync

    def _trust_changed(self) -> None:
        self._epoch += 1

    def sync(self, source: SourceKey) -> SourceSync:
        return self._syncs.get(source) or self.register(source)

    def sources(self) -> list[SourceKey]:
        return list(self._known)

    def trust(self, source: SourceKey) -> Trust:
        if self.stores is not None and self.stores.is_store(source):
            return self.stores.trust(self.stores.stores.sources.index(source))
        if source in self.block_size_mismatch:
            return Trust.DEGRADED
        sync = self._syncs.get(source)
        return sync.trust if sync else Trust.COLD

    def remove_instance(self, instance: str) -> None:
        """Forget every source of an instance (it left the fleet)."""
        for src in [s for s in self._known if s.instance == instance]:
            self.index.drop_source(src)
            self._known.pop(src, None)
            self._syncs.pop(src, None)
            self.block_size_mismatch.pop(src, None)
            self.last_event_ts.pop(src, None)
        self._epoch += 1

    def forget_source(self, source: SourceKey) -> None:
        """Drop a source's blocks and sequence state (silent too long); it shows as cold until it returns."""
        self.index.clear_source(source)
        old = self._syncs.get(source)
        self._syncs[source] = self._new_sync(old.has_replay if old else False)
        self.block_size_mismatch.pop(source, None)

    def source_of(self, instance: str, payload: bytes, default_rank: int = 0) -> SourceKey:
        """The publisher a payload comes from (bind mode: the rank is read from the batch)."""
        try:
            rank = self._decoder.decode_rank(payload)
        except DecodeError:
            rank = None
        return SourceKey(instance, default_rank if rank is None else rank)

    # ------------------------------------------------------------------ sequenced ingestion (shells)
    def on_message(self, source: SourceKey, seq: int, payload: bytes) -> list[int]:
        """A live message.  Returns the replay start sequences the shell must request, if any."""
        return self._run(source, self.sync(source).on_live(seq, payload, peek_ts(payload)))

    def on_connect(self, source: SourceKey) -> list[int]:
        return self._run(source, self.sync(source).on_connect())

    def on_idle(self, source: SourceKey) -> list[int]:
        """The source has been quiet for a while: the replay that would reveal a lost last batch, if any."""
        return self._run(source, self.sync(source).on_idle())

    def on_replay(self, source: SourceKey, seq: int, payload: bytes) -> list[int]:
        return self._run(source, self.sync(source).on_replay(seq, payload, peek_ts(payload)))

    def on_replay_end(self, source: SourceKey, *, complete: bool = True) -> list[int]:
        """The replay ended: with its end marker (``complete``), or by timeout / not at all."""
        return self._run(source, self.sync(source).on_replay_end(complete=complete))

    def _run(self, source: SourceKey, actions: list[Action]) -> list[int]:
        replays: list[int] = []
        for act in actions:
            if isinstance(act, Apply):
                self.apply_payload(source.instance, act.payload, dp_rank=source.dp_rank, _source=source)
            elif isinstance(act, Reset):
                self.index.clear_source(source)
                self.block_size_mismatch.pop(source, None)
            elif isinstance(act, Replay):
                replays.append(act.start)
        return replays

    # ------------------------------------------------------------------ applying
    def apply_payload(
        self, instance: str, payload: bytes, *, dp_rank: int = 0, _source: SourceKey | None = None
    ) -> int:
        """Apply one raw vLLM batch.  Returns the number of events applied.

        A payload that does not decode is counted (``decode_errors``) and dropped; an event that cannot be
        applied is counted (``event_errors``) and skipped; neither ever raises.
        """
        c = self.counters
        c.batches += 1
        fast = self._fast
        if fast is not None:
            src = _source or SourceKey(instance, dp_rank)
            ix = self.index
            slot = ix.slot_id(src)
            if slot is not None:  # (a source's first blocks take the reference path)
                status, n_ev, ts, rank, nb, done = ix.ingest(slot, fast, payload, -2 if _source else dp_rank)
                if status == fast_apply.WRONG_SOURCE:  # direct use: the batch names its rank
                    src = SourceKey(instance, rank)
                    slot = ix.slot_id(src)
                    if slot is not None:
                        status, done = fast_wire.ACCEPTED, ix.apply_parsed(slot, fast, n_ev, nb)
                if status == fast_wire.ACCEPTED:
                    self._begin(src, ts, direct=_source is None)
                    if done:
                        self.applier.count_fast(fast, done)
                    if done == n_ev:
                        return done
                    return done + self.applier.apply(src, self._decoder.decode(payload).events, done, ts)
        try:
            batch = self._decoder.decode(payload)
        except DecodeError as e:
            c.decode_errors[e.reason] += 1
            return 0
        if batch.skipped:
            c.skipped_events.update(batch.skipped)
        src = _source or SourceKey(instance, dp_rank if batch.dp_rank is None else batch.dp_rank)
        self._begin(src, batch.ts, direct=_source is None)
        return self.applier.apply(src, batch.events, 0, batch.ts)

    def _begin(self, src: SourceKey, ts: float, *, direct: bool) -> None:
        if src not in self._known:
            self.register(src)
        if direct:
            # Direct library use: the caller owns ordering, so the stream is taken as complete.
            sync = self.sync(src)
            if sync.trust is Trust.COLD:
                sync.trust = Trust.EXACT
        self.last_event_ts[src] = ts
        if self.stores is not None:
            self.stores.age(ts)

    # ------------------------------------------------------------------ lookups
    def chain_hashes(
        self, token_ids: TokenIds, *, lora_name: str | None = None, cache_salt: str | None = None
    ) -> I64Array:
        """``hashing.request_chains`` at this index's block size."""
        return request_chains(token_ids, self.block_size, lora_name=lora_name, cache_salt=cache_salt)

    def lookup(
        self,
        token_ids: TokenIds,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        now: float | None = None,
    ) -> LookupResult:
        """Matched leading blocks per (instance, dp_rank), with the tier split and the source's trust.

        Hashing stops early: blocks are chained in growing chunks and hashing ends once no source holds the
        last chunk's first block, so a miss costs one small chunk, not the whole prompt.
        """
        if now is not None:
            self.index.expire(now)
        base = base_hash(lora_name, cache_salt)
        if isinstance(token_ids, np.ndarray):
            # The gateway's input (the tokenizer cache keeps arrays): hashed during the index walk.
            return self._answer(self.index.match_token_rows(token_ids, self.block_size, base), len(token_ids))
        return self._lookup(self._prompt_chains(token_ids, base), len(token_ids))

    def lookup_chains(self, chains: I64Array, num_tokens: int, *, now: float | None = None) -> LookupResult:
        if now is not None:
            self.index.expire(now)
        return self._lookup(chains, num_tokens)

    def _prompt_chains(self, tokens: TokenIds, base: int) -> I64Array:
        """The prompt's chain hashes, up to the first chunk whose first block nobody holds."""
        bs = self.block_size
        total = len(tokens) // bs
        done = 0
        prev = base
        chunk = 32
        parts: list[I64Array] = []
        while done < total:
            n = min(chunk, total - done)
            chains = chained_hashes(tokens, bs, done, n, prev)
            parts.append(chains)
            done += n
            prev = int(chains[-1])
            if not self.index.held_by_any(prev):
                break
            chunk *= 2
        if not parts:
            return _NO_CHAINS
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _lookup(self, chains: I64Array, num_tokens: int) -> LookupResult:
        return self._answer(self.index.match_rows(chains), num_tokens)

    def _answer(self, rows: I64Array, num_tokens: int) -> LookupResult:
        """The in-process index's rows as a result, from kept answers (one gather at a thousand sources,
        not a thousand new objects)."""
        ix = self.index
        version = (self._epoch, ix.slots_version, tuple(self.block_size_mismatch))
        if self._answers.version != version:
            self._answers.rebuild(
                version,
                list(self._known),
                ix.slot_id,
                lambda s: self.trust(s).value,
                ix.slot_count(),
                ix.store_names,
            )
        out = self._answers.answer(rows)
        if out is None:
            return self._result(num_tokens, ix.rows_to_matches(rows))
        return LookupResult(self.block_size, num_tokens, out, self._store_trust())

    def _store_trust(self) -> dict[str, str]:
        st = self.stores
        if st is None:
            return {}
        return {n: st.trust(i).value for i, n in enumerate(st.stores.names)}

    def _result(self, num_tokens: int, matches: list[SourceMatch]) -> LookupResult:
        bs = self.block_size
        by_src = {m.source: m for m in matches}
        out: list[InstanceMatch] = []
        for src in list(self._known) + [s for s in by_src if s not in self._known and s.dp_rank >= 0]:
            m = by_src.get(src)
            blocks = m.blocks if m else 0
            tiers = {"GPU": m.gpu if m else 0}
            if m and m.cpu:
                tiers["CPU"] = m.cpu
            if m and m.storage:
                tiers["STORAGE"] = m.storage
            if m and m.shared:
                tiers.update(m.shared)
            out.append(
                InstanceMatch(
                    src.instance,
                    src.dp_rank,
                    blocks,
                    blocks * bs,
                    tiers,
                    m.speculative if m else 0,
                    self.trust(src).value,
                )
            )
        return LookupResult(bs, num_tokens, out, self._store_trust())

    def footprint(self, source: SourceKey) -> int:
        """GPU blocks ``source`` holds plus its unconfirmed speculative entries: how much of its cache the
        traffic sent there fills.  Every router that takes in the same events and speculative entries
        counts the same."""
        return self.index.blocks(source)[Medium.GPU] + self.index.speculative_blocks(source)

    def clears(self, source: SourceKey) -> int:
        """How many times the source's cache was emptied (AllBlocksCleared, an engine restart, the source
        forgotten or gone), as this process's index saw it; 0 when the index lives out of process."""
        return self.index.clears(source) if isinstance(self.index, BlockIndex) else 0

    def holding(self, source: SourceKey, chains: I64Array) -> npt.NDArray[np.uint8] | None:
        """Per chain, how ``source`` holds it (``BlockIndex.holding``: one bit per medium stored in, and
        ``SPECULATIVE_BIT`` for an entry not yet confirmed).  None when the index lives out of process."""
        if not isinstance(self.index, BlockIndex):
            return None
        return self.index.holding(source, chains)

    # ------------------------------------------------------------------ speculative entries
    def add_speculative(self, source: SourceKey, chains: I64Array, *, now: float) -> None:
        self.index.add_speculative(source, chains, now=now, ttl=self.speculative_ttl)
        if self.speculative_outbox is not None:
            self.speculative_outbox.append(SpeculativeEntry(source, chains, now))

    # ------------------------------------------------------------------ warm restart
    def snapshot(self, *, created_at: float = 0.0) -> bytes:
        """Blocks, sequence positions, last timestamps and trust, versioned (see ``indexer.snapshot``)."""
        return _snapshot.take(self, created_at=created_at)

    def restore(self, data: bytes, *, only: Collection[SourceKey] | None = None) -> list[SourceKey]:
        """Load a snapshot before subscribing; the on-connect replay then fills only what was missed."""
        return _snapshot.restore(self, data, only=only)
