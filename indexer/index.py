"""The block index: which chained block hashes each source holds, in which medium.

::

    sources ──slot──▶ group = slot // 64, bit = 1 << (slot % 64)

    _maps[medium][group] : ChainHash ──▶ int64 mask of the group's slots holding it   (cykhash, 16 B/entry)
    _engine[slot]        : EngineHash ──▶ ChainHash                                   (cykhash, per source)
    _extra_refs          : (slot, medium, ChainHash) ──▶ references beyond the first  (sparse)

A lookup chains the prompt, reads every group's masks for the chain in one C call per map (stopping at the
first block nobody holds), ANDs them cumulatively and reads each source's matched depth off the points
where the running mask loses bits.  Holes end a match: a block missing from a source ends that source's
match even if later blocks are present.

Invariants
* a chain hash is a key of ``_maps[m][g]`` iff some slot of group g holds it in medium m (mask != 0);
* ``_engine[slot]`` maps exactly the engine hashes whose chain the slot holds in at least one medium;
* a slot's reference count for (chain, medium) is ``bit set`` + ``_extra_refs`` (duplicates are counted).

Pure: no I/O, no clock (speculative entries take ``now`` from the caller).
"""

from __future__ import annotations

import heapq
import itertools

import cykhash
import msgspec
import numpy as np

from .errors import SourceOverCapacity
from .hashing import I64Array
from .types import ChainHash, Medium, SourceKey

GROUP = 64
# Speculative updates of at most this many chains use per-key calls: for a short prompt they cost a
# fifth of the vectorised path's temporary maps (0.6 against 3.3 us for two chains).
_SMALL_BATCH = 16
MEDIA = tuple(Medium)


def _bit(slot: int) -> int:
    """The slot's bit as a signed int64 (bit 63 is negative)."""
    b = 1 << (slot % GROUP)
    return b - (1 << 64) if b >> 63 else b


class SourceMatch(msgspec.Struct, gc=False):
    """How many leading blocks of a prompt one source holds, split by where they live."""

    source: SourceKey
    blocks: int = 0
    gpu: int = 0
    cpu: int = 0
    storage: int = 0
    speculative: int = 0


class _Spec(msgspec.Struct, gc=False):
    expiry: float
    slot: int
    chains: I64Array


class SourceBlocks(msgspec.Struct, array_like=True, gc=False):
    """One source's blocks as plain int64 little-endian arrays: the unit of a snapshot.

    ``engines[i]`` resolves to ``engine_chains[i]``; ``held[m]`` lists the chains held in medium ``m``;
    ``extra_chains[m]`` / ``extra_counts[m]`` the references beyond the first (duplicate stores)."""

    source: SourceKey
    engines: bytes
    engine_chains: bytes
    held: list[bytes]
    extra_chains: list[bytes]
    extra_counts: list[bytes]


def _i64(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, dtype="<i8").tobytes()


def _arr(b: bytes) -> I64Array:
    return np.frombuffer(b, dtype="<i8").astype(np.int64)


class BlockIndex:
    """The pure index.  Not thread-safe: one owner applies writes; reads are synchronous calls."""

    def __init__(self, *, max_blocks_per_source: int = 8_000_000) -> None:
        self.max_blocks_per_source = max_blocks_per_source
        self._slots: dict[SourceKey, int] = {}
        self._keys: list[SourceKey | None] = []
        self._free: list[int] = []
        self._maps: dict[Medium, list[cykhash.Int64toInt64Map]] = {m: [] for m in MEDIA}
        self._engine: list[cykhash.Int64toInt64Map | None] = []
        self._counts: list[list[int]] = []
        self._extra_refs: dict[tuple[int, Medium, int], int] = {}
        # speculative entries: one map per group, plus per-(slot, chain) expiry
        self._spec: list[cykhash.Int64toInt64Map] = []
        self._spec_expiry: dict[int, cykhash.Int64toFloat64Map] = {}
        # A heap by expiry: peers' entries (shared router state) arrive with what is left of their TTL, so
        # entries are not added in expiry order.
        self._spec_queue: list[tuple[float, int, _Spec]] = []
        self._spec_seq = itertools.count()

    # ------------------------------------------------------------------ sources
    def slot_of(self, source: SourceKey) -> int:
        """The source's slot, allocated on first use."""
        slot = self._slots.get(source)
        if slot is not None:
            return slot
        if self._free:
            slot = self._free.pop()
            self._keys[slot] = source
        else:
            slot = len(self._keys)
            self._keys.append(source)
            self._engine.append(None)
            self._counts.append([0, 0, 0])
            if slot % GROUP == 0:
                for m in MEDIA:
                    self._maps[m].append(cykhash.Int64toInt64Map())
                self._spec.append(cykhash.Int64toInt64Map())
        self._engine[slot] = cykhash.Int64toInt64Map()
        self._counts[slot] = [0, 0, 0]
        self._slots[source] = slot
        return slot

    def sources(self) -> list[SourceKey]:
        return list(self._slots)

    def blocks(self, source: SourceKey) -> dict[Medium, int]:
        slot = self._slots.get(source)
        if slot is None:
            return {m: 0 for m in MEDIA}
        return {m: self._counts[slot][m] for m in MEDIA}

    def total_entries(self) -> int:
        """(source, block, medium) entries held."""
        return sum(sum(c) for c, k in zip(self._counts, self._keys) if k is not None)

    def engine_chain(self, source: SourceKey, engine_hash: int) -> ChainHash | None:
        """The chain hash the source's engine hash resolves to (to chain a child, or to link an offload)."""
        slot = self._slots.get(source)
        if slot is None:
            return None
        em = self._engine[slot]
        assert em is not None
        v = em.get(engine_hash)
        return None if v is None else ChainHash(v)

    # ------------------------------------------------------------------ writes
    def store(self, source: SourceKey, engine_hashes: I64Array, chains: I64Array, medium: Medium) -> None:
        """Record that the source holds these blocks in ``medium`` (idempotent up to reference counts)."""
        n = len(chains)
        if n == 0:
            return
        slot = self.slot_of(source)
        counts = self._counts[slot]
        if counts[medium] + n > self.max_blocks_per_source:
            raise SourceOverCapacity(
                f"{source.label()} would hold more than {self.max_blocks_per_source} blocks"
            )
        g, bit = slot // GROUP, _bit(slot)
        gmap = self._maps[medium][g]
        masks = np.empty(n, dtype=np.int64)
        cykhash.Int64toInt64Map_to(gmap, chains, masks, False, 0)
        held = (masks & bit) != 0
        cykhash.update_int64toint64map(gmap, cykhash.Int64toInt64Map_from_buffers(chains, masks | bit))
        n_held = int(np.count_nonzero(held))
        counts[medium] += n - n_held
        if n_held:
            for i in np.flatnonzero(held).tolist():
                key = (slot, medium, int(chains[i]))
                self._extra_refs[key] = self._extra_refs.get(key, 0) + 1
        em = self._engine[slot]
        assert em is not None
        cykhash.update_int64toint64map(em, cykhash.Int64toInt64Map_from_buffers(engine_hashes, chains))
        if self._spec_expiry:
            self._confirm(slot, chains)

    def remove(self, source: SourceKey, engine_hashes: I64Array, medium: Medium) -> int:
        """Drop one reference per engine hash.  Returns how many hashes were unknown (already gone)."""
        n = len(engine_hashes)
        slot = self._slots.get(source)
        if slot is None or n == 0:
            return n
        if n > 1 and len(np.unique(engine_hashes)) < n:
            # The same hash twice in one call: each removal must see the previous one's effect.
            return sum(self.remove(source, engine_hashes[i : i + 1], medium) for i in range(n))
        em = self._engine[slot]
        assert em is not None
        g, bit = slot // GROUP, _bit(slot)
        gmap = self._maps[medium][g]
        chains = np.empty(n, dtype=np.int64)
        if cykhash.Int64toInt64Map_to(em, engine_hashes, chains, False, 0) != n:
            known = np.fromiter((e in em for e in engine_hashes.tolist()), dtype=bool, count=n)
            engine_hashes, chains = engine_hashes[known], chains[known]
        masks = np.empty(len(chains), dtype=np.int64)
        cykhash.Int64toInt64Map_to(gmap, chains, masks, False, 0)
        held = (masks & bit) != 0
        if not held.all():
            engine_hashes, chains, masks = engine_hashes[held], chains[held], masks[held]
        unknown = n - len(chains)
        if self._extra_refs:
            keep = np.ones(len(chains), dtype=bool)
            for i, c in enumerate(chains.tolist()):
                key = (slot, medium, c)
                extra = self._extra_refs.get(key)
                if extra:
                    keep[i] = False
                    if extra == 1:
                        del self._extra_refs[key]
                    else:
                        self._extra_refs[key] = extra - 1
            engine_hashes, chains, masks = engine_hashes[keep], chains[keep], masks[keep]
        if not len(chains):
            return unknown
        self._clear_bits(gmap, chains, masks, bit)
        self._counts[slot][medium] -= len(chains)
        # Engine ids go once the source holds the block in no medium at all.
        elsewhere = np.zeros(len(chains), dtype=bool)
        for m in MEDIA:
            other = self._maps[m][g]
            if m != medium and self._counts[slot][m] and len(other):
                om = np.empty(len(chains), dtype=np.int64)
                cykhash.Int64toInt64Map_to(other, chains, om, False, 0)
                elsewhere |= (om & bit) != 0
        for e in engine_hashes[~elsewhere].tolist():
            em.discard(e)
        return unknown

    def clear_source(self, source: SourceKey) -> None:
        """Forget every block of the source (AllBlocksCleared, engine restart).  The slot stays allocated."""
        slot = self._slots.get(source)
        if slot is None:
            return
        em = self._engine[slot]
        assert em is not None
        g, bit = slot // GROUP, _bit(slot)
        for m in MEDIA:
            if not self._counts[slot][m]:
                continue
            gmap = self._maps[m][g]
            for c in set(em.values()):
                if gmap.get(c, 0) & bit:
                    self._clear_bit(gmap, c, bit)
        self._engine[slot] = cykhash.Int64toInt64Map()
        self._counts[slot] = [0, 0, 0]
        self._extra_refs = {k: v for k, v in self._extra_refs.items() if k[0] != slot}
        self._drop_spec(slot)

    def drop_source(self, source: SourceKey) -> None:
        """Forget the source entirely and free its slot."""
        if source not in self._slots:
            return
        self.clear_source(source)
        slot = self._slots.pop(source)
        self._keys[slot] = None
        self._engine[slot] = None
        self._free.append(slot)

    @staticmethod
    def _clear_bits(gmap: cykhash.Int64toInt64Map, chains: I64Array, masks: I64Array, bit: int) -> None:
        """Clear ``bit`` in the masks of ``chains`` (currently ``masks``); a key whose mask empties goes."""
        rest = masks & ~bit
        gone = rest == 0
        for c in chains[gone].tolist():
            gmap.discard(c)
        if not gone.all():
            cykhash.update_int64toint64map(
                gmap, cykhash.Int64toInt64Map_from_buffers(chains[~gone], rest[~gone])
            )

    @staticmethod
    def _clear_bit(gmap: cykhash.Int64toInt64Map, c: int, bit: int) -> None:
        m = gmap.get(c, 0) & ~bit  # an absent key stays absent
        if m:
            gmap[c] = m
        else:
            gmap.discard(c)

    # ------------------------------------------------------------------ speculative entries
    def add_speculative(self, source: SourceKey, chains: I64Array, *, now: float, ttl: float) -> None:
        """These blocks were just sent to ``source``: count them as held until confirmed or expired."""
        if len(chains) == 0:
            return
        self.expire(now)
        slot = self.slot_of(source)
        g, bit = slot // GROUP, _bit(slot)
        smap = self._spec[g]
        expiry = now + ttl
        exp = self._spec_expiry.get(slot)
        if exp is None:
            exp = self._spec_expiry[slot] = cykhash.Int64toFloat64Map()
        if len(chains) <= _SMALL_BATCH:
            # A short prompt (one request per call on the gateway's path): per-key calls cost a fifth of
            # building the temporary maps the vectorised updates need.
            for c in chains.tolist():
                smap[c] = smap.get(c, 0) | bit
                exp[c] = expiry
        else:
            masks = np.empty(len(chains), dtype=np.int64)
            cykhash.Int64toInt64Map_to(smap, chains, masks, False, 0)
            cykhash.update_int64toint64map(smap, cykhash.Int64toInt64Map_from_buffers(chains, masks | bit))
            cykhash.update_int64tofloat64map(
                exp, cykhash.Int64toFloat64Map_from_buffers(chains, np.full(len(chains), expiry))
            )
        heapq.heappush(self._spec_queue, (expiry, next(self._spec_seq), _Spec(expiry, slot, chains.copy())))

    def expire(self, now: float) -> None:
        """Drop speculative entries whose time has passed, earliest expiry first; a block re-sent later
        carries the later expiry, so an old queue item leaves it alone."""
        q = self._spec_queue
        while q and q[0][0] <= now:
            item = heapq.heappop(q)[2]
            exp = self._spec_expiry.get(item.slot)
            if exp is None or not len(exp):
                continue
            if len(item.chains) <= _SMALL_BATCH:
                g, bit = item.slot // GROUP, _bit(item.slot)
                smap = self._spec[g]
                for c in item.chains.tolist():
                    if exp.get(c, np.inf) <= now:
                        exp.discard(c)
                        self._clear_bit(smap, c, bit)
                continue
            cur = np.empty(len(item.chains), dtype=np.float64)
            cykhash.Int64toFloat64Map_to(exp, item.chains, cur, False, np.inf)
            self._drop_spec_chains(item.slot, item.chains[cur <= now])

    def speculative_blocks(self, source: SourceKey) -> int:
        """Blocks counted as held by ``source`` on speculative entries alone (not yet confirmed)."""
        slot = self._slots.get(source)
        exp = None if slot is None else self._spec_expiry.get(slot)
        return 0 if exp is None else len(exp)

    def speculative_entries(self) -> int:
        return sum(len(m) for m in self._spec_expiry.values())

    def _drop_spec_chains(self, slot: int, chains: I64Array) -> None:
        if not len(chains):
            return
        exp = self._spec_expiry[slot]
        for c in chains.tolist():
            exp.discard(c)
        g, bit = slot // GROUP, _bit(slot)
        smap = self._spec[g]
        masks = np.empty(len(chains), dtype=np.int64)
        cykhash.Int64toInt64Map_to(smap, chains, masks, False, 0)
        self._clear_bits(smap, chains, masks, bit)

    def _confirm(self, slot: int, chains: I64Array) -> None:
        exp = self._spec_expiry.get(slot)
        if exp is None or not len(exp):
            return
        cur = np.empty(len(chains), dtype=np.float64)
        if cykhash.Int64toFloat64Map_to(exp, chains, cur, False, np.nan):
            self._drop_spec_chains(slot, chains[~np.isnan(cur)])

    def _drop_spec(self, slot: int) -> None:
        exp = self._spec_expiry.get(slot)
        if exp is not None and len(exp):
            self._drop_spec_chains(slot, np.fromiter(exp.keys(), dtype=np.int64, count=len(exp)))

    # ------------------------------------------------------------------ snapshots
    def export_sources(self) -> list[SourceBlocks]:
        """Every source's blocks (speculative entries excluded: they live seconds, on a process clock)."""
        tables: dict[tuple[Medium, int], tuple[I64Array, I64Array]] = {}

        def table(m: Medium, g: int) -> tuple[I64Array, I64Array]:
            t = tables.get((m, g))
            if t is None:
                gmap = self._maps[m][g]
                keys = np.fromiter(gmap.keys(), dtype=np.int64, count=len(gmap))
                vals = np.empty(len(keys), dtype=np.int64)
                cykhash.Int64toInt64Map_to(gmap, keys, vals, False, 0)
                t = tables[(m, g)] = (keys, vals)
            return t

        extra: dict[tuple[int, Medium], list[tuple[int, int]]] = {}
        for (slot, m, c), n in self._extra_refs.items():
            extra.setdefault((slot, m), []).append((c, n))
        out = []
        for source, slot in self._slots.items():
            g, bit = slot // GROUP, _bit(slot)
            em = self._engine[slot]
            assert em is not None
            engines = np.fromiter(em.keys(), dtype=np.int64, count=len(em))
            chains = np.empty(len(engines), dtype=np.int64)
            cykhash.Int64toInt64Map_to(em, engines, chains, False, 0)
            held, xc, xn = [], [], []
            for m in MEDIA:
                keys, vals = table(m, g) if self._counts[slot][m] else (np.zeros(0, np.int64),) * 2
                held.append(_i64(keys[(vals & bit) != 0]))
                pairs = extra.get((slot, m), [])
                xc.append(_i64(np.array([c for c, _ in pairs], dtype=np.int64)))
                xn.append(_i64(np.array([n for _, n in pairs], dtype=np.int64)))
            out.append(SourceBlocks(source, _i64(engines), _i64(chains), held, xc, xn))
        return out

    def import_sources(self, blocks: list[SourceBlocks]) -> None:
        """Load exported sources into this index; each must hold nothing here yet."""
        for sb in blocks:
            slot = self.slot_of(SourceKey(*sb.source))
            if any(self._counts[slot]):
                raise ValueError(f"{sb.source[0]}/{sb.source[1]} already holds blocks")
            g, bit = slot // GROUP, _bit(slot)
            em = self._engine[slot]
            assert em is not None
            cykhash.update_int64toint64map(
                em, cykhash.Int64toInt64Map_from_buffers(_arr(sb.engines), _arr(sb.engine_chains))
            )
            for m in MEDIA:
                chains = _arr(sb.held[m])
                gmap = self._maps[m][g]
                masks = np.empty(len(chains), dtype=np.int64)
                cykhash.Int64toInt64Map_to(gmap, chains, masks, False, 0)
                cykhash.update_int64toint64map(
                    gmap, cykhash.Int64toInt64Map_from_buffers(chains, masks | bit)
                )
                self._counts[slot][m] = len(chains)
                for c, n in zip(_arr(sb.extra_chains[m]).tolist(), _arr(sb.extra_counts[m]).tolist()):
                    self._extra_refs[(slot, m, c)] = n

    # ------------------------------------------------------------------ reads
    def held_by_any(self, chain_hash: int) -> bool:
        """Whether any source holds (or is about to hold) this block, in any medium."""
        for maps in self._maps.values():
            for mp in maps:
                if chain_hash in mp:
                    return True
        return any(chain_hash in mp for mp in self._spec)

    def match(self, chains: I64Array) -> list[SourceMatch]:
        """Matched leading blocks per source, for sources matching at least one block."""
        n = len(chains)
        out: list[SourceMatch] = []
        if n == 0:
            return out
        for g in range(len(self._spec)):
            self._match_group(g, chains, out)
        return out

    def _match_group(self, g: int, chains: I64Array, out: list[SourceMatch]) -> None:
        n = len(chains)
        layers: list[tuple[int, np.ndarray]] = []  # (kind, masks): kind 0..2 = Medium, 3 = speculative
        maps = [(int(m), self._maps[m][g]) for m in MEDIA]
        maps.append((3, self._spec[g]))
        live = [(k, mp) for k, mp in maps if len(mp)]
        if not live:
            return
        if len(live) == 1:
            masks = np.empty(n, dtype=np.int64)
            found = cykhash.Int64toInt64Map_to(live[0][1], chains, masks, True, 0)
            if not found:
                return
            anyv = masks[:found]
            layers.append((live[0][0], anyv))
        else:
            anyv = np.zeros(n, dtype=np.int64)
            for k, mp in live:
                masks = np.empty(n, dtype=np.int64)
                cykhash.Int64toInt64Map_to(mp, chains, masks, False, 0)
                anyv |= masks
                layers.append((k, masks))
            zero = np.flatnonzero(anyv == 0)
            found = int(zero[0]) if len(zero) else n
            if not found:
                return
            anyv = anyv[:found]
        acc = np.bitwise_and.accumulate(anyv)
        # acc only loses bits as it goes; a slot's depth is where its bit disappears.
        depth_of: dict[int, int] = {}
        change = (np.flatnonzero(acc[1:] != acc[:-1]) + 1).tolist()
        prev = int(acc[0])
        for k in change:
            cur = int(acc[k])
            self._bits_into(prev & ~cur, k, depth_of)
            prev = cur
        self._bits_into(prev, found, depth_of)
        single_gpu = len(layers) == 1 and layers[0][0] == Medium.GPU
        for b, depth in depth_of.items():
            slot = g * GROUP + b
            key = self._keys[slot]
            if key is None:
                continue
            sm = SourceMatch(key, depth)
            if single_gpu:
                sm.gpu = depth
            else:
                self._split_tiers(sm, layers, _bit(slot), depth)
            out.append(sm)

    @staticmethod
    def _bits_into(mask: int, depth: int, depth_of: dict[int, int]) -> None:
        mask &= (1 << 64) - 1
        while mask:
            low = mask & -mask
            depth_of[low.bit_length() - 1] = depth
            mask ^= low

    @staticmethod
    def _split_tiers(sm: SourceMatch, layers: list[tuple[int, np.ndarray]], bit: int, depth: int) -> None:
        """Each matched block counts once, in the best tier holding it: GPU, CPU, STORAGE, speculative."""
        taken = np.zeros(depth, dtype=bool)
        for kind, masks in sorted(layers, key=lambda x: x[0]):
            has = ((masks[:depth] & bit) != 0) & ~taken
            cnt = int(np.count_nonzero(has))
            taken |= has
            if kind == Medium.GPU:
                sm.gpu = cnt
            elif kind == Medium.CPU:
                sm.cpu = cnt
            elif kind == Medium.STORAGE:
                sm.storage = cnt
            else:
                sm.speculative = cnt
