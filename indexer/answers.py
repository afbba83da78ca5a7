"""A lookup's answer: one ``InstanceMatch`` per known source, built without one new object per source.

A lookup lists every known source, matched or not.  At a thousand sources, making a thousand Structs costs
more than walking the index, so answers are kept and reused::

    objs  = [zero answer of known source 0, 1, ..., n-1,  kept answers (source, depth) ...]
    kept  : position | depth << 24 ──▶ index into objs            (cykhash)
    lookup: rows of the index ──numpy──▶ index per known source ──take──▶ list (in C)

A kept answer depends on the known sources, their slots and their trust; the owner passes a ``version``
that changes with any of them, and a new version starts the cache afresh.  Answers are therefore shared
between lookups: callers treat them as read-only (``msgspec.structs.replace`` derives a changed one).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import cykhash
import msgspec
import numpy as np
import numpy.typing as npt
from numba import njit

from .hashing import I64Array
from .types import SourceKey

_POS_BITS = 24  # positions of known sources below 2**24 (an index holds at most ~1M sources)
_BULK_MIN = 64  # from this many matched sources on, answers start from a kept list (``_from_template``)


_MIX = np.uint64(0x9E3779B97F4A7C15)


@njit(cache=True)
def _survey(rows: Any, pos_of_slot: Any, pos: Any) -> Any:
    """Fill ``pos`` (each row's known-source position) and find the longest run of one depth (rows come
    by increasing depth).  Returns (0 if a row's source is unknown, else 1 if every row is GPU-only, 2 if
    not; the run's depth; its start and end; two fingerprints, independent of order, of the positions
    from its start to the last row: every source that matched at least that deep)."""
    n = len(rows)
    plain = True
    for r in range(n):
        s = rows[r, 0]
        if s >= len(pos_of_slot) or pos_of_slot[s] < 0:
            return 0, 0, 0, 0, 0, 0
        pos[r] = pos_of_slot[s]
        for c in range(2, rows.shape[1]):
            if rows[r, c]:
                plain = False
    best_lo, best_n, lo = 0, 0, 0
    for r in range(1, n + 1):
        if r == n or rows[r, 1] != rows[lo, 1]:
            if r - lo > best_n:
                best_lo, best_n = lo, r - lo
            lo = r
    fingerprint_a = np.uint64(0)
    fingerprint_b = np.uint64(0)
    for r in range(best_lo, n):
        x = np.uint64(pos[r]) * _MIX
        fingerprint_a += x ^ (x >> np.uint64(29))
        fingerprint_b += (x + _MIX) * (x | np.uint64(1))
    return (
        1 if plain else 2,
        rows[best_lo, 1],
        best_lo,
        best_lo + best_n,
        np.int64(fingerprint_a),
        np.int64(fingerprint_b),
    )


@njit(cache=True)
def _members(mask: Any, pos: Any) -> bool:
    """Every position in ``pos`` (distinct positions) is set in ``mask``."""
    for p in pos:  # noqa: SIM110 - compiled by numba, which takes no generator here
        if p >= len(mask) or not mask[p]:
            return False
    return True


class InstanceMatch(msgspec.Struct, gc=False):
    """One source's answer to a lookup."""

    instance: str
    dp_rank: int
    matched_blocks: int
    matched_tokens: int
    tiers: dict[str, int]
    speculative_blocks: int
    trust: str


class LookupResult(msgspec.Struct, gc=False):
    """Every known source's match (``InstanceMatch`` objects may be shared between results: read-only).
    ``stores``: the trust of each shared store whose blocks a match's ``tiers`` may name."""

    block_size: int
    num_tokens: int
    instances: list[InstanceMatch]
    stores: dict[str, str] = {}

    def best(self) -> InstanceMatch | None:
        return max(self.instances, key=lambda m: m.matched_blocks, default=None)


def make_match(
    src: SourceKey,
    block_size: int,
    trust: str,
    blocks: int,
    cpu: int,
    storage: int,
    spec: int,
    shared: dict[str, int] | None = None,
) -> InstanceMatch:
    """A source's answer: each matched block counted once, in its best tier (GPU, CPU, STORAGE, then
    speculative, then a shared store it attaches, by store name); tiers other than GPU are listed only
    when not 0."""
    tiers = {"GPU": blocks - cpu - storage - spec - (sum(shared.values()) if shared else 0)}
    if cpu:
        tiers["CPU"] = cpu
    if storage:
        tiers["STORAGE"] = storage
    if shared:
        tiers.update(shared)
    return InstanceMatch(src.instance, src.dp_rank, blocks, blocks * block_size, tiers, spec, trust)


class AnswerCache:
    """Kept answers of one index state (see the module docstring)."""

    def __init__(self, block_size: int, *, max_kept: int = 1 << 16, max_templates: int = 256) -> None:
        self.block_size = block_size
        self.max_kept = max_kept
        self.max_templates = max_templates
        self._templates: dict[
            tuple[int, int, int, int], tuple[npt.NDArray[np.bool_], list[InstanceMatch]]
        ] = {}
        self.version: Hashable = None
        self._known: list[SourceKey] = []
        self._trust: list[str] = []
        self._objs = np.empty(0, dtype=object)  # answers (object array: gathered by ``take``)
        self._n_objs = 0
        self._kept = cykhash.Int64toInt64Map()
        self._pos_of_slot = np.zeros(0, dtype=np.int64)
        self.store_names: list[str] = []

    def rebuild(
        self,
        version: Hashable,
        known: Sequence[SourceKey],
        slot_of: Callable[[SourceKey], int | None],
        trust_of: Callable[[SourceKey], str],
        n_slots: int,
        store_names: Sequence[str] = (),
    ) -> None:
        self.version = version
        self.store_names = list(store_names)
        self._known = list(known)
        self._trust = [trust_of(s) for s in self._known]
        self._objs = np.empty(max(64, 2 * len(self._known)), dtype=object)
        self._n_objs = 0
        for s, t in zip(self._known, self._trust):
            self._push(make_match(s, self.block_size, t, 0, 0, 0, 0))
        self._kept = cykhash.Int64toInt64Map()
        self._templates.clear()
        pos = np.full(n_slots, -1, dtype=np.int64)
        for i, s in enumerate(self._known):
            slot = slot_of(s)
            if slot is not None:
                pos[slot] = i
        self._pos_of_slot = pos

    def _push(self, m: InstanceMatch) -> int:
        i = self._n_objs
        if i == len(self._objs):
            grown = np.empty(2 * i, dtype=object)
            grown[:i] = self._objs
            self._objs = grown
        self._objs[i] = m
        self._n_objs = i + 1
        return i

    def answer(self, rows: I64Array) -> list[InstanceMatch] | None:
        """Answers for index rows ``[slot, blocks, cpu, storage, speculative, shared ..]``, in known-source
        order; None when a row's source is not a known one (the caller then builds the answer itself)."""
        n = len(self._known)
        if not len(rows):
            return self._objs[:n].tolist()
        pos = np.empty(len(rows), dtype=np.int64)
        status, d, lo, hi, fingerprint_a, fingerprint_b = _survey(rows, self._pos_of_slot, pos)
        if status == 0:
            return None
        if self._n_objs > n + self.max_kept:
            self._objs[n : self._n_objs] = None
            self._n_objs = n
            self._kept = cykhash.Int64toInt64Map()
            self._templates.clear()
        if status == 1 and hi - lo >= _BULK_MIN:
            return self._from_template(
                pos, rows, d, lo, hi, (d, len(rows) - lo, fingerprint_a, fingerprint_b)
            )
        sel = np.arange(n, dtype=np.int64)
        plain = ~rows[:, 2:].any(axis=1)
        ppos, depth = (pos, rows[:, 1]) if status == 1 else (pos[plain], rows[plain, 1])
        sel[ppos] = self._kept_answers(ppos, depth)
        out: list[InstanceMatch] = self._objs.take(sel).tolist()
        if status == 2:
            # Tier splits beyond GPU (offloaded or speculative blocks): made for this answer only.
            names = self.store_names
            for i in np.flatnonzero(~plain).tolist():
                p = int(pos[i])
                row = rows[i].tolist()
                _, blocks, cpu, sto, spec = row[:5]
                shared = {n: b for n, b in zip(names, row[5:]) if b} if names else None
                out[p] = make_match(
                    self._known[p], self.block_size, self._trust[p], blocks, cpu, sto, spec, shared
                )
        return out

    def _kept_answers(self, pos: I64Array, depth: I64Array) -> I64Array:
        """Indices in ``_objs`` of the plain answers (source at ``pos``, ``depth`` GPU blocks), made once."""
        keys = pos | (depth << _POS_BITS)
        idx = np.empty(len(keys), dtype=np.int64)
        cykhash.Int64toInt64Map_to(self._kept, keys, idx, False, -1)
        for i in np.flatnonzero(idx < 0).tolist():
            p, d = int(pos[i]), int(depth[i])
            idx[i] = self._push(make_match(self._known[p], self.block_size, self._trust[p], d, 0, 0, 0))
            self._kept[int(keys[i])] = int(idx[i])
        return idx

    def _from_template(
        self, pos: I64Array, rows: I64Array, d: int, lo: int, hi: int, key: tuple[int, int, int, int]
    ) -> list[InstanceMatch]:
        """Many sources matched, most at one depth ``d`` (the blocks of a shared prefix): rows ``lo:hi``.
        The answer with every source that matched at least ``d`` blocks (rows ``lo:``) at ``d`` and
        everyone else at 0 is kept as a list, keyed by ``d`` and those sources (the sources holding a
        prefix, the same for every prompt that starts with it, whichever of them holds the prompt's
        tail); a lookup copies it and sets the few sources at other depths."""
        bpos = pos[lo:]
        tpl = self._templates.get(key)
        if tpl is None or not _members(tpl[0], bpos):  # (the key holds the count: same count, same set)
            n = len(self._known)
            sel = np.arange(n, dtype=np.int64)
            sel[bpos] = self._kept_answers(bpos, np.full(len(bpos), d, dtype=np.int64))
            if len(self._templates) >= self.max_templates:
                self._templates.clear()
            mask = np.zeros(n, dtype=np.bool_)
            mask[bpos] = True
            tpl = self._templates[key] = (mask, self._objs.take(sel).tolist())
        out = tpl[1].copy()
        if lo or hi < len(rows):
            for part in (slice(0, lo), slice(hi, len(rows))):
                for p, depth in zip(pos[part].tolist(), rows[part, 1].tolist()):
                    i = self._kept.get(p | depth << _POS_BITS)
                    if i is None:
                        m = make_match(self._known[p], self.block_size, self._trust[p], depth, 0, 0, 0)
                        i = self._kept[p | depth << _POS_BITS] = self._push(m)
                    out[p] = self._objs[i]
        return out
