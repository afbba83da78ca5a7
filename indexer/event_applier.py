"""Applying one source's decoded KV events to the block index (and the fleet's shared stores): the
reference path every event can take, and the counters of what was applied, skipped or refused.

::

    BlockStored ──token ids──▶ content hashes ──chained on the parent (or the LoRA/salt base)──▶ store
                └─placeholder (offload tier, no token ids)──▶ linked by engine hash to known blocks
    BlockRemoved (runs of them: one call) ──▶ remove, per medium / shared store
    AllBlocksCleared ──▶ clear the source

An event that cannot be applied is counted by reason (``Counters.event_errors``) and skipped; it never
raises out of ``EventApplier.apply``.  Offload copies whose parent comes later in the same batch are
retried once the rest is in (vLLM's offload tiers announce a batch's chunks in no particular order).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import msgspec
import numpy as np

from . import fast_apply, fast_wire
from .errors import (
    BadBlockShape,
    BlockSizeMismatch,
    EventError,
    OffloadParentUnknown,
    UnknownParent,
)
from .extra_keys import decode_block_keys, event_content
from .fast_ingest import IngestScratch
from .hashing import (
    I64Array,
    TokenEncodingError,
    base_hash,
    chain,
    content_hashes_raw,
)
from .index import BlockIndex
from .sources import SourceSync
from .store_writer import StoreWriter
from .types import Medium, SourceKey
from .wire import BlockRemoved, BlockStored, Event, engine_hash_i64


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


class EventApplier:
    """Applies decoded events of any source; owned by one ``Indexer`` and sharing its state.

    ``sync`` gives a source's sequence state (a parent never seen degrades it, a clear resets it);
    ``block_size_mismatch`` records the block size a source announced when it differs from ours."""

    def __init__(
        self,
        block_size: int,
        index: BlockIndex,
        stores: StoreWriter | None,
        counters: Counters,
        sync: Callable[[SourceKey], SourceSync],
        block_size_mismatch: dict[SourceKey, int],
    ) -> None:
        self.block_size = block_size
        self.index = index
        self.stores = stores
        self.counters = counters
        self.sync = sync
        self.block_size_mismatch = block_size_mismatch

    def count_fast(self, fast: IngestScratch, done: int) -> None:
        """Counters for the ``done`` events the fast path applied (as ``_stored`` / ``_removed`` count
        them)."""
        c = self.counters
        o = fast.out.tolist()
        c.events += done
        new, cleared = fast_apply.NEW, fast_apply.CLEARED
        c.blocks_stored += o[new] + o[new + 1] + o[new + 2] + o[fast_apply.HELD]
        c.blocks_removed += o[cleared] + o[cleared + 1] + o[cleared + 2]
        if o[fast_apply.UNKNOWN_REMOVED]:
            c.event_errors["unknown_removed_block"] += o[fast_apply.UNKNOWN_REMOVED]
        if o[fast_apply.UNKNOWN_LINKED]:
            c.event_errors["unknown_offload_block"] += o[fast_apply.UNKNOWN_LINKED]
        if not o[fast_apply.OFFLOAD_ROWS]:
            return
        # Offload rows (no shared stores here: each feeds the instance's own tier), counted per event in
        # order as ``_stored`` / ``_link_offload`` count them.
        for kind, m, nb, _, _, _, bo, _ in fast.rows[:done].tolist():
            name = Medium(m).name
            if kind == fast_wire.LINK:
                linked = nb - int(np.count_nonzero(fast.flags[bo : bo + nb] == fast_apply.UNKNOWN))
                c.placeholder_events += 1
                c.placeholder_blocks += linked
                c.offload_blocks[name] += linked
            elif kind == fast_wire.STORED and m != 0:
                c.offload_blocks[name] += nb

    def apply(self, src: SourceKey, events: list[Event], start: int, ts: float) -> int:
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
                    # Read while catching up (a late join's replay), the clear is older than what the
                    # router sent meanwhile: its speculative entries stay (``BlockIndex.clear_source``).
                    sync = self.sync(src)
                    self.index.clear_source(src, history=sync.catching_up)
                    c.clears += 1
                    sync.on_cleared()
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
        engines = self.engine_array(ev.block_hashes)
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
        else:
            self.index.store_content(src, engines, content, prev, medium)  # chained there, in one call
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
        hashes = self.engine_array(block_hashes)
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
    def engine_array(hashes: Sequence[int | bytes]) -> I64Array:
        try:
            return np.array(hashes, dtype=np.uint64).view(np.int64)
        except (OverflowError, TypeError, ValueError):
            return np.array([engine_hash_i64(h) for h in hashes], dtype=np.int64)

    def _event_base(self, ev: BlockStored) -> int:
        """The chain base of a sequence's first block: LoRA name and the salt found in its extra keys."""
        salt = decode_block_keys(ev.extra_keys[0], ev.lora_name, first=True).salt if ev.extra_keys else None
        return base_hash(ev.lora_name, salt)

    def _mix_extras(
        self, content: I64Array, extras: list[object], lora_name: str | None, *, first: bool
    ) -> I64Array:
        """Blocks with extra keys beyond LoRA and the first block's salt get them mixed into their content
        hash (``indexer.extra_keys``): multimodal items as a request with the same items computes them,
        anything else (prompt embeddings) so that no request's block matches."""
        return event_content(content, extras, lora_name, first=first)
