"""``Indexer``: the library API.  Decodes vLLM payloads, tracks sequences and trust, keeps the block index.

::

    payload ──BatchDecoder──▶ events ──chain tokens──▶ BlockIndex.store / remove / clear_source
    (seq)   ──SourceSync────▶ apply | replay request | reset

Pure: no sockets, no clock (callers pass ``now``), counters are plain attributes the shells export.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import numpy.typing as npt

from . import fast_apply as fa
from . import fast_wire as fw
from . import snapshot as _snapshot
from .answers import AnswerCache, InstanceMatch, LookupResult
from .backend import IndexBackend
from .errors import (
    BadBlockShape,
    BlockSizeMismatch,
    DecodeError,
    EventError,
    OffloadParentUnknown,
    UnknownParent,
)
from .fast_ingest import IngestScratch
from .hashing import (
    I64Array,
    TokenEncodingError,
    TokenIds,
    base_hash,
    chain,
    chain_one,
    chained_hashes,
    content_hashes_raw,
    request_chains,
    stable_key_hash,
    warmup,
)
from .index import BlockIndex, SourceMatch
from .sources import Action, Apply, Replay, Reset, SourceSync
from .store_writer import StoreWriter
from .tiers import SharedStoreConfig, SharedStores
from .types import Medium, SourceKey, Trust
from .wire import BatchDecoder, BlockRemoved, BlockStored, Event, engine_hash_i64, peek_ts

if TYPE_CHECKING:
    from .config import FleetConfig

_U64_MAX = (1 << 64) - 1
_NO_CHAINS: I64Array = np.zeros(0, dtype=np.int64)


class SpeculativeEntry(msgspec.Struct, gc=False):
    """A speculative entry this process added (``Indexer.speculative_outbox``), for a shell to share."""

    source: SourceKey
    chains: I64Array
    now: float


class Counters(msgspec.Struct):
    """Ingestion counters, exported by the shells as Prometheus metrics."""

    batches: int = 0
    events: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    clears: int = 0
    decode_errors: Counter[str] = msgspec.field(default_factory=Counter)
    event_errors: Counter[str] = msgspec.field(default_factory=Counter)
    skipped_events: Counter[str] = msgspec.field(default_factory=Counter)
    placeholder_events: int = 0
    """BlockStored events of an offload tier without token ids (vLLM's OffloadingConnector without
    ``self_describing_kv_events``): linked to known blocks by engine hash, or not at all."""
    placeholder_blocks: int = 0
    """Blocks those events named that were linked."""
    offload_blocks: Counter[str] = msgspec.field(default_factory=Counter)
    """Blocks stored beyond the GPU, by tier: CPU, STORAGE (an instance's own), or a shared store's name."""
    remote_unshared: int = 0
    """Offload blocks announced with locality REMOTE that no shared store of the fleet file takes (kept
    as the announcing instance's own)."""


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
        index: IndexBackend | None = None,
        shared: list[SharedStoreConfig] | None = None,
        fast_ingest: bool = True,
    ) -> None:
        """``index``: another backend (e.g. ``indexer.redis_index.RedisBlockIndex``); default in process.
        ``shared``: the fleet file's shared stores (``indexer.tiers``; in-process index only).
        ``fast_ingest``: payloads of the common shapes parsed and applied in compiled code
        (``indexer.fast_ingest``; the in-process index only, and only without shared stores: their routing
        of offload events is the reference path's alone); off, every payload takes the reference path
        (same results)."""
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.speculative_ttl = speculative_ttl
        warmup()
        self.index: IndexBackend = (
            index if index is not None else BlockIndex(max_blocks_per_source=max_blocks_per_source)
        )
        self.stores: StoreWriter | None = None
        if shared:
            if not isinstance(self.index, BlockIndex):
                raise ValueError("shared stores need the in-process index")
            self.stores = StoreWriter(self.index, SharedStores(shared))
        # The fast path never runs with shared stores (offload events may feed a store there, and stores
        # age per batch): every payload then takes the reference path.
        self._fast = (
            IngestScratch(block_size)
            if fast_ingest and isinstance(self.index, BlockIndex) and self.stores is None
            else None
        )
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
        and holds the old and new arrays at once) until the fleet holds more.  Other backends ignore it."""
        if isinstance(self.index, BlockIndex) and sources > 0 and blocks_per_source > 0:
            self.index.reserve(sources * blocks_per_source, per_source=blocks_per_source)

    def register(self, source: SourceKey, *, has_replay: bool = False) -> SourceSync:
        """Declare a publisher (from the fleet file) so it is reported, as cold, before it sends anything."""
        if source not in self._known:
            self._known[source] = None
            self._epoch += 1
            if self.stores is not None and isinstance(self.index, BlockIndex):
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
            assert isinstance(ix, BlockIndex)
            slot = ix.slot_id(src)
            if slot is not None:  # (a source's first blocks take the reference path)
                status, n_ev, ts, rank, nb, done = ix.ingest(slot, fast, payload, -2 if _source else dp_rank)
                if status == fa.WRONG_SOURCE:  # direct use: the batch names its rank
                    src = SourceKey(instance, rank)
                    slot = ix.slot_id(src)
                    if slot is not None:
                        status, done = fw.ACCEPTED, ix.apply_parsed(slot, fast, n_ev, nb)
                if status == fw.ACCEPTED:
                    self._begin(src, ts, direct=_source is None)
                    if done:
                        self._count_fast(fast, done)
                    if done == n_ev:
                        return done
                    return done + self._apply_events(src, self._decoder.decode(payload).events, done, ts)
        try:
            batch = self._decoder.decode(payload)
        except DecodeError as e:
            c.decode_errors[e.reason] += 1
            return 0
        if batch.skipped:
            c.skipped_events.update(batch.skipped)
        src = _source or SourceKey(instance, dp_rank if batch.dp_rank is None else batch.dp_rank)
        self._begin(src, batch.ts, direct=_source is None)
        return self._apply_events(src, batch.events, 0, batch.ts)

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

    def _count_fast(self, fast: IngestScratch, done: int) -> None:
        """Counters for the ``done`` events the fast path applied (as ``_stored`` / ``_removed`` count
        them)."""
        c = self.counters
        o = fast.out.tolist()
        c.events += done
        c.blocks_stored += o[fa.NEW] + o[fa.NEW + 1] + o[fa.NEW + 2] + o[fa.HELD]
        c.blocks_removed += o[fa.CLEARED] + o[fa.CLEARED + 1] + o[fa.CLEARED + 2]
        if o[fa.UNKNOWN_REMOVED]:
            c.event_errors["unknown_removed_block"] += o[fa.UNKNOWN_REMOVED]
        if o[fa.UNKNOWN_LINKED]:
            c.event_errors["unknown_offload_block"] += o[fa.UNKNOWN_LINKED]
        if not o[fa.OFFLOAD_ROWS]:
            return
        # Offload rows (no shared stores here: each feeds the instance's own tier), counted per event in
        # order as ``_stored`` / ``_link_offload`` count them.
        for kind, m, nb, _, _, _, bo, _ in fast.rows[:done].tolist():
            name = Medium(m).name
            if kind == fw.LINK:
                linked = nb - int(np.count_nonzero(fast.flags[bo : bo + nb] == fa.UNKNOWN))
                c.placeholder_events += 1
                c.placeholder_blocks += linked
                c.offload_blocks[name] += linked
            elif kind == fw.STORED and m != 0:
                c.offload_blocks[name] += nb

    def _apply_events(self, src: SourceKey, events: list[Event], start: int, ts: float) -> int:
        """The reference path: events ``start ..`` of a decoded batch, one by one (runs of removals as one
        call; offload copies whose parent is not yet known retried after the rest).  Returns how many were
        applied."""
        c = self.counters
        applied = 0
        deferred: list[BlockStored] = []
        i, n = start, len(events)
        while i < n:
            ev = events[i]
            if isinstance(ev, BlockRemoved):
                # vLLM sends one BlockRemoved per evicted block; a run of them is one index call.
                j = i + 1
                while (
                    j < n
                    and isinstance(events[j], BlockRemoved)
                    and events[j].medium == ev.medium  # type: ignore[union-attr]
                    and events[j].group_idx == ev.group_idx  # type: ignore[union-attr]
                    and events[j].locality == ev.locality  # type: ignore[union-attr]
                    and events[j].ownership == ev.ownership  # type: ignore[union-attr]
                ):
                    j += 1
                run = events[i:j]
                c.events += j - i
                try:
                    self._removed(src, ev, [h for e in run for h in e.block_hashes])  # type: ignore[union-attr]
                    applied += j - i
                except (EventError, ValueError, TypeError, OverflowError) as e:
                    c.event_errors[getattr(e, "reason", "bad_field")] += j - i
                except RecursionError:
                    c.event_errors["too_deep"] += j - i
                i = j
                continue
            i += 1
            c.events += 1
            try:
                if isinstance(ev, BlockStored):
                    self._stored(src, ev, ts)
                else:
                    self.index.clear_source(src)
                    c.clears += 1
                    self.sync(src).on_cleared()
                applied += 1
            except OffloadParentUnknown:
                # vLLM's offload tiers announce a batch's chunks in no particular order: a child may come
                # before its parent.  Tried again once the rest of the batch is in.
                deferred.append(ev)  # type: ignore[arg-type]
            except EventError as e:
                c.event_errors[e.reason] += 1
                if isinstance(e, UnknownParent):
                    self.sync(src).mark_degraded()
            except (ValueError, TypeError, OverflowError):
                c.event_errors["bad_field"] += 1
            except RecursionError:
                # extra_keys nested near the recursion limit decode, then fail to re-encode for hashing
                c.event_errors["too_deep"] += 1
        for ev in deferred:
            try:
                self._stored(src, ev, ts)
                applied += 1
            except EventError as e:
                # An offload copy whose parent is known nowhere: the tier holds a block no prompt can
                # reach through this index (its prefix is gone), so nothing is lost by skipping it.
                c.event_errors[e.reason] += 1
            except (ValueError, TypeError, OverflowError):
                c.event_errors["bad_field"] += 1
        return applied

    def _stored(self, src: SourceKey, ev: BlockStored, ts: float = 0.0) -> None:
        if ev.group_idx not in (None, 0):
            # Hybrid models: only the first KV-cache group decides prefix reuse for routing.
            self.counters.skipped_events["other_group"] += 1
            return
        medium = Medium.GPU if ev.medium is None or ev.medium == "GPU" else Medium.parse(ev.medium)
        n = len(ev.block_hashes)
        if n == 0:
            return
        engines = self._engine_array(ev.block_hashes)
        store = -1
        if medium is not Medium.GPU:
            store = self._store_of(src, medium, ev.locality, ev.ownership, n)
        raw = memoryview(ev.token_ids)
        if len(raw) == 1 and raw[0] == 0x90:
            # An offload placeholder: the same engine hashes as blocks already known.
            self.counters.placeholder_events += 1
            self._link_offload(src, engines, medium, store, ts)
            return
        bs = ev.block_size
        if bs != self.block_size:
            self.block_size_mismatch[src] = bs
            raise BlockSizeMismatch(self.block_size, bs)
        try:
            content, count = content_hashes_raw(raw, bs)
        except TokenEncodingError as e:
            raise BadBlockShape(f"token_ids: {e}") from None
        if count != n * bs:
            raise BadBlockShape(f"{count} tokens for {n} blocks of {bs}")
        if ev.parent_block_hash is None:
            prev = self._event_base(ev)
        else:
            ph = engine_hash_i64(ev.parent_block_hash)
            parent: int | None = self.index.engine_chain(src, ph)
            if parent is None and store >= 0 and self.stores is not None:
                parent = self.stores.engine_chain(store, ph)
            if parent is None:
                if medium is Medium.GPU:
                    raise UnknownParent(f"{src.label()}: parent {ev.parent_block_hash!r}")
                if self._known_engines(src, engines):
                    # A self-describing offload copy of blocks whose GPU copies are known: link them.
                    self._link_offload(src, engines, medium, store, ts, placeholder=False)
                    return
                raise OffloadParentUnknown(f"{src.label()}: offload parent {ev.parent_block_hash!r}")
            prev = parent
        extras = ev.extra_keys
        if extras and any(extras):
            content = self._mix_extras(content, extras, ev.lora_name, first=ev.parent_block_hash is None)
        if store >= 0:
            assert self.stores is not None
            self.counters.offload_blocks[self.stores.stores.names[store]] += n
            self.stores.write(store, engines, chain(content, prev), ts)
        elif isinstance(self.index, BlockIndex):
            self.index.store_content(src, engines, content, prev, medium)  # chained there, in one call
        else:
            self.index.store(src, engines, chain(content, prev), medium)
        if medium is not Medium.GPU and store < 0:
            self.counters.offload_blocks[medium.name] += n
        self.counters.blocks_stored += n

    def _store_of(
        self, src: SourceKey, medium: Medium, locality: str | None, ownership: str | None, n: int
    ) -> int:
        """The shared store an offload event feeds (-1: the instance's own tier)."""
        store = self.stores.stores.route(src.instance, medium, locality, ownership) if self.stores else -1
        if store < 0 and locality == "REMOTE":
            self.counters.remote_unshared += n
        return store

    def _known_engines(self, src: SourceKey, engines: I64Array) -> bool:
        return all(self.index.engine_chain(src, e) is not None for e in engines.tolist())

    def _link_offload(
        self,
        src: SourceKey,
        engines: I64Array,
        medium: Medium,
        store: int,
        ts: float,
        *,
        placeholder: bool = True,
    ) -> None:
        chains = np.empty(len(engines), dtype=np.int64)
        keep = np.ones(len(engines), dtype=bool)
        for i, e in enumerate(engines.tolist()):
            c: int | None = self.index.engine_chain(src, e)
            if c is None and store >= 0 and self.stores is not None:
                c = self.stores.engine_chain(store, e)
            if c is None:
                keep[i] = False
            else:
                chains[i] = c
        missing = int(np.count_nonzero(~keep))
        if missing:
            self.counters.event_errors["unknown_offload_block"] += missing
        linked = len(engines) - missing
        if placeholder:
            self.counters.placeholder_blocks += linked
        if store >= 0:
            assert self.stores is not None
            self.stores.write(store, engines[keep], chains[keep], ts)
            self.counters.offload_blocks[self.stores.stores.names[store]] += linked
        else:
            self.index.store(src, engines[keep], chains[keep], medium)
            self.counters.offload_blocks[medium.name] += linked
        self.counters.blocks_stored += linked

    def _removed(self, src: SourceKey, ev: BlockRemoved, block_hashes: list[int | bytes]) -> None:
        if ev.group_idx not in (None, 0):
            self.counters.skipped_events["other_group"] += 1
            return
        medium = Medium.parse(ev.medium)
        hashes = self._engine_array(block_hashes)
        if medium is not Medium.GPU and self.stores is not None:
            store = self.stores.stores.route(src.instance, medium, ev.locality, ev.ownership)
            if store >= 0:
                chains = np.array(
                    [self.index.engine_chain(src, h) or 0 for h in hashes.tolist()], dtype=np.int64
                )
                unknown = self.stores.remove(store, hashes, chains)
                self.counters.blocks_removed += len(hashes) - unknown
                if unknown:
                    self.counters.event_errors["unknown_removed_block"] += unknown
                return
        unknown = self.index.remove(src, hashes, medium)
        self.counters.blocks_removed += len(hashes) - unknown
        if unknown:
            self.counters.event_errors["unknown_removed_block"] += unknown

    @staticmethod
    def _engine_array(hashes: Sequence[int | bytes]) -> I64Array:
        try:
            return np.array(hashes, dtype=np.uint64).view(np.int64)
        except (OverflowError, TypeError, ValueError):
            return np.array([engine_hash_i64(h) for h in hashes], dtype=np.int64)

    @staticmethod
    def _strip_lora(key: Sequence[object] | None, lora_name: str | None) -> list[object]:
        if not key:
            return []
        items = list(key)
        if lora_name is not None and items and items[0] == lora_name:
            items = items[1:]
        return items

    def _event_base(self, ev: BlockStored) -> int:
        """The chain base of a sequence's first block: LoRA name and the salt found in its extra keys."""
        salt: str | None = None
        if ev.extra_keys:
            first = self._strip_lora(ev.extra_keys[0], ev.lora_name)
            if len(first) == 1 and isinstance(first[0], str):
                salt = first[0]
        return base_hash(ev.lora_name, salt)

    def _mix_extras(
        self, content: I64Array, extras: list[object], lora_name: str | None, *, first: bool
    ) -> I64Array:
        """Blocks with extra keys beyond LoRA and the first block's salt (multimodal ids, prompt embeddings)
        get a content hash no text request produces, so they never match a plain-text lookup."""
        out = content.copy()
        for i, key in enumerate(extras[: len(out)]):
            rest = self._strip_lora(key if isinstance(key, list | tuple) else None, lora_name)
            if i == 0 and first and len(rest) == 1 and isinstance(rest[0], str):
                continue  # the salt, already in the base
            if rest:
                out[i] = chain_one(int(out[i]), stable_key_hash(rest))
        return out

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
        if isinstance(token_ids, np.ndarray) and isinstance(self.index, BlockIndex):
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
        ix = self.index
        if not isinstance(ix, BlockIndex):
            return self._result(num_tokens, ix.match(chains) if len(chains) else [])
        return self._answer(ix.match_rows(chains), num_tokens)

    def _answer(self, rows: I64Array, num_tokens: int) -> LookupResult:
        """The in-process index's rows as a result, from kept answers (one gather at a thousand sources,
        not a thousand new objects)."""
        ix = self.index
        assert isinstance(ix, BlockIndex)
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

    def footprint(self, source: SourceKey) -> int | None:
        """GPU blocks ``source`` holds plus its unconfirmed speculative entries: how much of its cache the
        traffic sent there fills.  Every router that takes in the same events and speculative entries
        counts the same.  None when the index lives out of process (asking would cost a round trip)."""
        if not isinstance(self.index, BlockIndex):
            return None
        return self.index.blocks(source)[Medium.GPU] + self.index.speculative_blocks(source)

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
