"""The block index: which chained block hashes each source holds, in which medium.

    _chains        : ChainHash -> the groups holding it (group = slot // 64), each with a mask of its
                     slots, plus per-kind masks where not all GPU                  (indexer.chain_table)
    _engine[slot]  : EngineHash -> ChainHash                                       (per source)
    _extra_refs    : (slot, medium, ChainHash) -> references beyond the first      (sparse)

A lookup chains the prompt and walks it once in the chain table (``indexer.match_walk``), stopping at the
first block nobody holds; its cost follows the matched depth and the groups holding those blocks, not
the number of sources.  A hole ends a source's match even if later blocks are present.

Invariants: a chain hash has an entry iff some slot holds it in some medium or speculatively, and a group
appears for it iff some slot of the group does; ``_engine[slot]`` maps exactly the engine hashes whose
chain the slot holds in some medium; a slot's reference count for (chain, medium) is ``bit set`` +
``_extra_refs``.  Pure: no I/O, no clock (speculative entries take ``now`` from the caller).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any

import cykhash
import msgspec
import numpy as np
import numpy.typing as npt

from . import fast_apply, fast_wire
from .chain_table import MAX_GROUPS, SPECULATIVE, ChainTable, ct_store_chained
from .engine_table import EngineTable
from .errors import SourceOverCapacity
from .fast_ingest import IngestScratch
from .hashing import I64Array, checked_tokens
from .match_walk import Shared, match_chains, match_tokens, no_shared
from .probing import grown
from .types import ChainHash, Medium, SourceKey

GROUP = 64
_U64 = (1 << 64) - 1
# Speculative updates of at most this many chains use per-key calls: for a short prompt they cost a
# fifth of the vectorised path's temporary maps.
_SMALL_BATCH = 16
MEDIA = tuple(Medium)
SPECULATIVE_BIT = 1 << SPECULATIVE
"""``holding``'s bit for a speculative entry; bit ``m`` is medium ``m``."""
STORED_BITS = SPECULATIVE_BIT - 1
_NO_COUNTS = np.zeros(3, dtype=np.int64)


def _bit(slot: int) -> int:
    """The slot's bit as a signed int64 (bit 63 is negative)."""
    b = 1 << (slot % GROUP)
    return b - (1 << 64) if b >> 63 else b


class _Match(msgspec.Struct, gc=False):
    source: SourceKey
    blocks: int = 0
    gpu: int = 0
    cpu: int = 0
    storage: int = 0
    speculative: int = 0


class SourceMatch(_Match, kw_only=True, gc=False):
    """How many leading blocks of a prompt one source holds, split by where they live (``shared``: blocks
    it holds no copy of that a shared store it attaches holds, by store)."""

    shared: dict[str, int] = {}


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
        self._chains = ChainTable()
        self._engine: list[EngineTable | None] = []
        self._counts: list[I64Array] = []  # per slot: chains held per medium (numpy: kernels update it)
        self._per_source = 0  # engine ids a new slot's table is sized for (``reserve``)
        self._extra_refs: dict[tuple[int, Medium, int], int] = {}
        # speculative entries: their bits live in the chain table (kind SPECULATIVE); per slot, the
        # expiry of each chain
        self._spec_expiry: dict[int, cykhash.Int64toFloat64Map] = {}
        # A heap by expiry: peers' entries (shared router state) arrive with what is left of their TTL, so
        # entries are not added in expiry order.
        self._spec_queue: list[tuple[float, int, _Spec]] = []
        self._spec_seq = itertools.count()
        self.slots_version = 0
        """Changes whenever a slot is given to or taken from a source."""
        self._clears: dict[SourceKey, int] = {}
        # Shared stores (``indexer.tiers``): their sources and the instances attached (None: all); the
        # walk's arrays are rebuilt when slots or stores change.
        self._stores: list[tuple[SourceKey, frozenset[str] | None]] = []
        self._shared: tuple[int, int, Shared] | None = None

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
            if slot // GROUP >= MAX_GROUPS:
                raise SourceOverCapacity(f"more than {MAX_GROUPS * GROUP} sources in one index")
            self._keys.append(source)
            self._engine.append(None)
            self._counts.append(_NO_COUNTS)
        # (a tenth over the size asked for: a source's holdings overshoot it by an event or two)
        self._engine[slot] = EngineTable(grown(16, self._per_source * 11 // 10) if self._per_source else 16)
        self._counts[slot] = np.zeros(3, dtype=np.int64)
        self._slots[source] = slot
        self.slots_version += 1
        return slot

    def reserve(self, blocks: int, *, per_source: int = 0) -> None:
        """Size the tables for ``blocks`` more distinct blocks over the fleet and, for every source given a
        slot from now on, ``per_source`` blocks: no growth (each rehashes its whole table and holds the old
        and new arrays at once) until the fleet holds more."""
        self._chains.presize(int(self._chains.st[0]) + blocks)
        self._per_source = per_source

    def slot_id(self, source: SourceKey) -> int | None:
        return self._slots.get(source)

    def slot_count(self) -> int:
        """Slots ever allocated (free ones included): an upper bound of every slot number."""
        return len(self._keys)

    def sources(self) -> list[SourceKey]:
        return list(self._slots)

    def blocks(self, source: SourceKey) -> dict[Medium, int]:
        slot = self._slots.get(source)
        if slot is None:
            return {m: 0 for m in MEDIA}
        return {m: int(self._counts[slot][m]) for m in MEDIA}

    def clears(self, source: SourceKey) -> int:
        """How many times the source's blocks were all forgotten (``clear_source``): what it held before
        the last one, the engine no longer holds."""
        return self._clears.get(source, 0)

    def total_entries(self) -> int:
        """(source, block, medium) entries held."""
        return sum(int(c.sum()) for c, k in zip(self._counts, self._keys) if k is not None)

    def nbytes(self) -> int:
        """Bytes of the tables' arrays (the index's bulk; Python bookkeeping per source not counted)."""
        return self._chains.nbytes() + sum(e.nbytes() for e in self._engine if e is not None)

    def engine_chain(self, source: SourceKey, engine_hash: int) -> ChainHash | None:
        """The chain hash the source's engine hash resolves to (to chain a child, or to link an offload)."""
        slot = self._slots.get(source)
        if slot is None:
            return None
        em = self._engine[slot]
        assert em is not None
        v = em.get_one(engine_hash)
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
        chains = np.ascontiguousarray(chains, dtype=np.int64)
        held = self._chains.set(chains, slot // GROUP, _bit(slot), int(medium))
        n_held = int(np.count_nonzero(held))
        counts[medium] += n - n_held
        if n_held:
            for c in chains[held].tolist():
                key = (slot, medium, c)
                self._extra_refs[key] = self._extra_refs.get(key, 0) + 1
        em = self._engine[slot]
        assert em is not None
        em.put(np.ascontiguousarray(engine_hashes, dtype=np.int64), chains)
        if self._spec_expiry:
            self._confirm(slot, chains)

    def store_content(
        self, source: SourceKey, engine_hashes: I64Array, content: I64Array, prev: int, medium: Medium
    ) -> I64Array:
        """``store`` of blocks given by their content hashes, chained after ``prev`` here (one compiled
        call for the whole event: the ingest path).  ``content`` becomes the chains; returns it."""
        n = len(content)
        if n == 0:
            return content
        slot = self.slot_of(source)
        counts = self._counts[slot]
        if counts[medium] + n > self.max_blocks_per_source:
            raise SourceOverCapacity(
                f"{source.label()} would hold more than {self.max_blocks_per_source} blocks"
            )
        em = self._engine[slot]
        assert em is not None
        self._chains.reserve(n)
        em.reserve(n)
        t = self._chains
        held, added = ct_store_chained(
            t.R, t.SP, t.st, em.E, content, np.uint64(prev & _U64), engine_hashes, slot // GROUP,
            _bit(slot), int(medium),
        )  # fmt: skip
        em.count += added
        n_held = int(np.count_nonzero(held))
        counts[medium] += n - n_held
        if n_held:
            for c in content[held].tolist():
                key = (slot, medium, c)
                self._extra_refs[key] = self._extra_refs.get(key, 0) + 1
        if self._spec_expiry:
            self._confirm(slot, content)
        return content

    def remove(self, source: SourceKey, engine_hashes: I64Array, medium: Medium) -> int:
        """Drop one reference per engine hash, in order.  Returns how many were unknown (already gone)."""
        n = len(engine_hashes)
        slot = self._slots.get(source)
        if slot is None or n == 0:
            return n
        em = self._engine[slot]
        assert em is not None
        t, g, bit, m, counts = self._chains, slot // GROUP, _bit(slot), int(medium), self._counts[slot]
        hashes = np.ascontiguousarray(engine_hashes, dtype=np.int64)
        out = np.zeros(fast_apply.OUT, dtype=np.int64)
        k = 0
        while k < n:
            # One call for the run; it stops at a held block only while further references exist.
            extra = bool(self._extra_refs)
            k = fast_apply.remove_hashes(t.R, t.SP, t.st, em.E, hashes, k, n, g, bit, m, extra, counts, out)
            if k == n:
                break
            c = em.get_one(int(hashes[k]))
            assert c is not None  # the call stopped at a block the slot holds
            key = (slot, medium, c)
            refs = self._extra_refs.get(key, 0)
            if refs:
                if refs == 1:
                    del self._extra_refs[key]
                else:
                    self._extra_refs[key] = refs - 1
            else:
                fast_apply.remove_hashes(
                    t.R, t.SP, t.st, em.E, hashes, k, k + 1, g, bit, m, False, counts, out
                )
            k += 1
        em.count -= int(out[fast_apply.ENGINES_REMOVED])
        return int(out[fast_apply.UNKNOWN_REMOVED])

    # ------------------------------------------------------------------ the ingest's fast path
    def ingest(
        self, slot: int, s: IngestScratch, payload: bytes, rank: int
    ) -> tuple[int, int, float, int, int, int]:
        """Parse a payload and apply it to the source in ``slot`` (``indexer.fast_apply.ingest``), growing
        the tables first if it needs room.  Returns (status, events, ts, the batch's rank, blocks, rows
        applied):
        ACCEPTED, or why nothing was applied (declined, or WRONG_SOURCE: the batch names another rank
        than ``rank``; -2 takes any)."""
        em = self._engine[slot]
        assert em is not None
        t = self._chains
        buf = np.frombuffer(payload, dtype=np.uint8)
        while True:
            status, n_ev, ts, r, nb, done = fast_apply.ingest(
                buf, s.block_size, s.rows, s.engines, s.blocks, s.flags, t.R, t.SP, t.st, em.E, em.count,
                slot // GROUP, _bit(slot), rank, bool(self._extra_refs), self._counts[slot],
                self.max_blocks_per_source, s.out,
            )  # fmt: skip
            if status != fast_wire.GROW:
                break
            s.grow(len(payload))
        if status == fast_apply.NEED_ROOM:
            return fast_wire.ACCEPTED, n_ev, ts, r, nb, self.apply_parsed(slot, s, n_ev, nb)
        if status == fast_wire.ACCEPTED:
            self._after(slot, em, s, done)
        return status, n_ev, ts, r, nb, done

    def apply_parsed(self, slot: int, s: IngestScratch, n_rows: int, n_blocks: int) -> int:
        """Apply rows ``s`` holds (parsed by ``ingest``) to the source in ``slot``; returns rows applied."""
        em = self._engine[slot]
        assert em is not None
        t = self._chains
        t.reserve(n_blocks)
        em.reserve(n_blocks)
        done: int = fast_apply.apply_rows(
            t.R, t.SP, t.st, em.E, s.rows, n_rows, s.engines, s.blocks, s.flags, slot // GROUP, _bit(slot),
            bool(self._extra_refs), self._counts[slot], self.max_blocks_per_source, s.out,
        )  # fmt: skip
        self._after(slot, em, s, done)
        return done

    def _after(self, slot: int, em: EngineTable, s: IngestScratch, done: int) -> None:
        """What the compiled call leaves to Python: the engine table's size, further references, the
        speculative entries the stored blocks confirm."""
        out = s.out
        em.count += int(out[fast_apply.ENGINES_ADDED] - out[fast_apply.ENGINES_REMOVED])
        exp = self._spec_expiry.get(slot)
        if not out[fast_apply.HELD] and (exp is None or not len(exp)):
            return
        for kind, m, nb, _, _, _, bo, _ in s.rows[:done].tolist():
            if kind != fast_wire.STORED and kind != fast_wire.LINK:
                continue
            chains, f = s.blocks[bo : bo + nb], s.flags[bo : bo + nb]
            for c in chains[f == fast_apply.ALREADY_HELD].tolist():
                key = (slot, Medium(m), c)
                self._extra_refs[key] = self._extra_refs.get(key, 0) + 1
            if exp is not None and len(exp):
                self._confirm(slot, chains[f != fast_apply.UNKNOWN])

    def clear_source(self, source: SourceKey, *, history: bool = False) -> None:
        """Forget every block of the source (AllBlocksCleared, engine restart).  The slot stays allocated.
        ``history``: the clear is read from a replay of the source's past (it is catching up): what the
        router sent since it started is not undone, so its speculative entries stay and the clear is not
        counted in ``clears`` (which voids the placements made before it)."""
        if not history:
            self._clears[source] = self._clears.get(source, 0) + 1
        slot = self._slots.get(source)
        if slot is None:
            return
        em = self._engine[slot]
        assert em is not None
        g, bit = slot // GROUP, _bit(slot)
        chains = np.unique(em.items()[1])
        for m in MEDIA:
            if self._counts[slot][m]:
                self._chains.clear(chains, g, bit, int(m))
        self._engine[slot] = EngineTable()
        self._counts[slot] = np.zeros(3, dtype=np.int64)
        self._extra_refs = {k: v for k, v in self._extra_refs.items() if k[0] != slot}
        if not history:
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
        self.slots_version += 1

    # ------------------------------------------------------------------ speculative entries
    def add_speculative(self, source: SourceKey, chains: I64Array, *, now: float, ttl: float) -> None:
        """These blocks were just sent to ``source``: count them as held until confirmed or expired."""
        if len(chains) == 0:
            return
        self.expire(now)
        slot = self.slot_of(source)
        chains = np.ascontiguousarray(chains, dtype=np.int64)
        expiry = now + ttl
        exp = self._spec_expiry.get(slot)
        if exp is None:
            exp = self._spec_expiry[slot] = cykhash.Int64toFloat64Map()
        self._chains.set(chains, slot // GROUP, _bit(slot), SPECULATIVE)
        if len(chains) <= _SMALL_BATCH:
            # A short prompt (one request per call on the gateway's path): per-key calls cost a fifth of
            # building the temporary map the vectorised update needs.
            for c in chains.tolist():
                exp[c] = expiry
        else:
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
                due = [c for c in item.chains.tolist() if exp.get(c, np.inf) <= now]
                self._drop_spec_chains(item.slot, np.array(due, dtype=np.int64))
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

    def holding(self, source: SourceKey, chains: I64Array) -> npt.NDArray[np.uint8]:
        """Per chain, how ``source`` holds it: bit ``m`` for each medium ``m`` it is stored in (GPU 0, CPU 1,
        STORAGE 2) and ``SPECULATIVE_BIT`` while a speculative entry counts it (0: not at all).  An entry
        past its expiry that no ``expire`` has dropped yet still shows."""
        slot = self._slots.get(source)
        if slot is None or not len(chains):
            return np.zeros(len(chains), dtype=np.uint8)
        return self._chains.kinds(np.ascontiguousarray(chains, dtype=np.int64), slot // GROUP, _bit(slot))

    @property
    def _spec(self) -> list[dict[int, int]]:
        """Per group of 64 slots: chain -> mask of the slots holding it speculatively (introspection)."""
        out: list[dict[int, int]] = [{} for _ in range(self._n_groups())]
        for slot, c, _ in self._chains.dump(SPECULATIVE).tolist():
            d = out[slot // GROUP]
            d[c] = d.get(c, 0) | _bit(slot)
        return out

    def _drop_spec_chains(self, slot: int, chains: I64Array) -> None:
        if not len(chains):
            return
        exp = self._spec_expiry[slot]
        for c in chains.tolist():
            exp.discard(c)
        self._chains.clear(np.ascontiguousarray(chains), slot // GROUP, _bit(slot), SPECULATIVE)

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
        rows = self._chains.dump()  # [slot, chain, medium], one row per (slot, chain, medium) held
        rows = rows[np.argsort(rows[:, 0] * 4 + rows[:, 2], kind="stable")]
        keys = rows[:, 0] * 4 + rows[:, 2]
        extra: dict[tuple[int, Medium], list[tuple[int, int]]] = {}
        for (slot, m, c), n in self._extra_refs.items():
            extra.setdefault((slot, m), []).append((c, n))
        out = []
        for source, slot in self._slots.items():
            em = self._engine[slot]
            assert em is not None
            engines, chains = em.items()
            held, xc, xn = [], [], []
            for m in MEDIA:
                lo, hi = np.searchsorted(keys, [slot * 4 + m, slot * 4 + m + 1])
                held.append(_i64(rows[lo:hi, 1]))
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
            em.put(_arr(sb.engines), _arr(sb.engine_chains))
            for m in MEDIA:
                chains = _arr(sb.held[m])
                self._chains.set(chains, g, bit, int(m))
                self._counts[slot][m] = len(chains)
                for c, n in zip(_arr(sb.extra_chains[m]).tolist(), _arr(sb.extra_counts[m]).tolist()):
                    self._extra_refs[(slot, m, c)] = n

    # ------------------------------------------------------------------ shared stores
    def set_shared(self, stores: list[tuple[SourceKey, frozenset[str] | None]]) -> None:
        """Declare shared stores: each a source whose blocks count for every source of the attached
        instances (None: every instance).  Store sources are never reported by lookups."""
        self._stores = list(stores)
        for src, _ in self._stores:
            self.slot_of(src)
        self._shared = None

    @property
    def store_names(self) -> list[str]:
        """The stores' labels, in the order of the rows' shared columns."""
        return [src.instance[1:] for src, _ in self._stores]

    def _shared_arrays(self) -> Shared:
        n_groups = self._n_groups()
        cached = self._shared
        if cached is not None and cached[0] == self.slots_version and cached[1] == n_groups:
            return cached[2]
        if not self._stores:
            sh = no_shared(n_groups)
        else:
            slots = np.array([self._slots[src] for src, _ in self._stores], dtype=np.int64)
            attach = np.zeros((len(slots), n_groups), dtype=np.int64)
            keep = np.full(n_groups, -1, dtype=np.int64)
            for slot in slots.tolist():
                keep[slot // GROUP] &= ~_bit(slot)
            for s, (_, names) in enumerate(self._stores):
                for src, slot in self._slots.items():
                    if src.dp_rank >= 0 and (names is None or src.instance in names):
                        attach[s, slot // GROUP] |= _bit(slot)
            sh = Shared(slots, attach, keep)
        self._shared = (self.slots_version, n_groups, sh)
        return sh

    # ------------------------------------------------------------------ reads
    def _n_groups(self) -> int:
        return (len(self._keys) + GROUP - 1) // GROUP

    def held_by_any(self, chain_hash: int) -> bool:
        """Whether any source holds (or is about to hold) this block, in any medium."""
        return self._chains.contains(chain_hash)

    def match_rows(self, chains: I64Array) -> I64Array:
        """``match`` as rows ``[slot, blocks, cpu, storage, speculative, shared per store ..]`` (GPU: the
        rest), no objects built: the lookup's fast path."""
        t = self._chains
        chains = np.ascontiguousarray(chains, dtype=np.int64)
        return match_chains(t.R, t.SP, chains, self._n_groups(), self._shared_arrays())

    def match_token_rows(self, tokens: npt.NDArray[np.integer[Any]], block_size: int, base: int) -> I64Array:
        """``match_rows`` of a prompt given as a token-id array: its full blocks hashed during the walk (and
        only up to the first block nobody holds).  Raises ``TokenEncodingError`` for ids outside uint32."""
        t = self._chains
        seg = checked_tokens(tokens[: len(tokens) // block_size * block_size], block_size)
        return match_tokens(t.R, t.SP, seg, block_size, base, self._n_groups(), self._shared_arrays())

    def match(self, chains: I64Array) -> list[SourceMatch]:
        """Matched leading blocks per source, for sources matching at least one block."""
        return self.rows_to_matches(self.match_rows(chains))

    def rows_to_matches(self, rows: I64Array) -> list[SourceMatch]:
        out: list[SourceMatch] = []
        names = self.store_names
        for row in rows.tolist():
            slot, depth, cpu, storage, spec = row[:5]
            key = self._keys[slot]
            if key is None:
                continue
            shared = {n: b for n, b in zip(names, row[5:]) if b}
            gpu = depth - cpu - storage - spec - sum(shared.values())
            out.append(SourceMatch(key, depth, gpu, cpu, storage, spec, shared=shared))
        return out
