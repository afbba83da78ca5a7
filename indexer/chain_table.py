"""The fleet's chain table: which groups of 64 sources hold each chain hash, in which kinds.

One open-addressing table (``indexer.probing``); tag 0 marks an empty bucket, so any 64-bit hash is a key::

    (chain, PRIMARY)    group g inline: mask of g's slots holding the chain | or -ng: held by ng >= 2 groups
    (chain, ORD + o)    the o-th of its ng groups, with that group's mask
    (chain, SIDE + g)   per-kind masks [gpu, cpu, storage, speculative] of group g, only while some slot
                        of g holds the chain in a kind other than GPU (without it, every bit is GPU)

Every entry of a chain has the chain's home bucket, so a lookup reads its groups in one probe run.

Invariants: a chain has a PRIMARY entry iff some slot holds it in some kind; a group's mask is never 0
(it is the OR of its kinds' masks); a group's side flag (bit 0 of ``g``) is set iff its SIDE row exists,
and that row's cpu | storage | speculative part is then not 0; a chain's ordinals are exactly 0 .. ng-1
with ng >= 2 (a chain left with one group goes back inline).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
from numba import njit

from .engine_table import et_put_inline
from .probing import grown, home, low_bit_index, stays

GROUP = 64
MAX_GROUPS = 16_382
"""Groups of 64 sources one table tells apart (tags and group fields are int16)."""
KINDS = 4  # GPU, CPU, STORAGE, speculative
SPECULATIVE = 3
PRIMARY = 1
ORD = 2
SIDE = ORD + MAX_GROUPS

BUCKET = np.dtype([("k", "<i8"), ("m", "<i8"), ("t", "<i2"), ("g", "<i2")])
"""One bucket: key (the chain hash), mask (or side row), tag, group field; packed, 20 bytes, so a probe
reads one cache line, not four arrays."""

CHAIN_LOAD = 0.8
CHAIN_GROWTH = 1.5
"""The fleet's table is fuller than ``probing.MAX_LOAD`` at most ``CHAIN_LOAD`` (a new chain's probe run is
scanned to its end) and grows by half (each growth rehashes every entry)."""

PRESIZED_LOAD = 0.7
"""The load a table sized ahead (``presize``) reaches when it holds the entries it was sized for."""

I64 = npt.NDArray[np.int64]
_P = np.uint64(0x9E3779B97F4A7C15)  # the chain multiplier of ``indexer.hashing``


@njit(inline="always")
def find(R: Any, k: Any, tag: Any) -> Any:
    cap = len(R)
    i = home(k, cap)
    while True:
        t = R[i].t
        if t == 0:
            return -1
        if t == tag and R[i].k == k:
            return i
        i += 1
        if i == cap:
            i = 0


@njit(inline="always")
def _insert(R: Any, st: Any, k: Any, tag: Any, m: Any, g: Any) -> Any:
    """Add an entry known to be absent (never moves another entry)."""
    cap = len(R)
    i = home(k, cap)
    while R[i].t != 0:
        i += 1
        if i == cap:
            i = 0
    R[i].k = k
    R[i].t = tag
    R[i].m = m
    R[i].g = g
    st[0] += 1
    return i


@njit(inline="always")
def _delete(R: Any, st: Any, i: Any) -> None:
    """Empty bucket ``i`` (moves later entries of its probe run back)."""
    cap = len(R)
    j = i
    while True:
        j += 1
        if j == cap:
            j = 0
        if R[j].t == 0:
            break
        if not stays(i, home(R[j].k, cap), j):
            R[i] = R[j]
            i = j
    R[i].t = 0
    st[0] -= 1


@njit(inline="always")
def _locate(R: Any, c: Any, g: Any) -> tuple[Any, Any, Any]:
    """(primary, group entry, ordinal) of chain ``c`` in group ``g``, -1 if absent (ordinal -1: inline);
    a chain absent altogether gives (-1, -1, the empty bucket ending its probe run).  One pass."""
    cap = len(R)
    i = home(c, cap)
    p = -1
    e = -1
    o = -1
    seen = 0
    ng = -1
    while R[i].t != 0:
        if R[i].k == c:
            t = np.int64(R[i].t)
            if t == PRIMARY:
                p = i
                meta = np.int64(R[i].g)
                if meta >= 0:
                    return (p, p, -1) if (meta >> 1) == g else (p, -1, -1)
                ng = -int(meta)
                if e >= 0 or seen == ng:
                    return p, e, o
            elif t < SIDE:
                seen += 1
                if (np.int64(R[i].g) >> 1) == g:
                    e = i
                    o = int(t) - ORD
                    if p >= 0:
                        return p, e, o
                elif p >= 0 and seen == ng:
                    return p, -1, -1
        i += 1
        if i == cap:
            i = 0
    return (p, e, o) if p >= 0 else (-1, -1, i)


@njit(inline="always")
def _side_alloc(SP: Any, st: Any) -> Any:
    # st[1]: free-row list head (free rows chain through SP[row, 0]), st[2]: rows ever used, st[3]: in use
    if st[1] >= 0:
        idx = st[1]
        st[1] = SP[idx, 0]
    else:
        idx = st[2]
        st[2] += 1
    for k in range(KINDS):
        SP[idx, k] = 0
    st[3] += 1
    return idx


@njit(inline="always")
def _set(R: Any, SP: Any, st: Any, c: Any, g: Any, bit: Any, kind: Any) -> Any:
    """Set ``bit`` of group ``g`` for chain ``c`` in ``kind``.  Returns whether it was already set."""
    p, e, o = _locate(R, c, g)
    if p < 0 and kind == 0:  # a new chain (the common case on ingest): into the bucket the scan ended at
        R[o].k = c
        R[o].t = PRIMARY
        R[o].m = bit
        R[o].g = g << 1
        st[0] += 1
        return False
    if e < 0:
        gv = g << 1
        if kind != 0:
            idx = _side_alloc(SP, st)
            SP[idx, kind] = bit
            _insert(R, st, c, SIDE + g, idx, 0)
            gv |= 1
        if p < 0:
            _insert(R, st, c, PRIMARY, bit, gv)
            return False
        meta = np.int64(R[p].g)
        if meta >= 0:  # inline -> two groups
            _insert(R, st, c, ORD, R[p].m, meta)
            _insert(R, st, c, ORD + 1, bit, gv)
            R[p].m = 0
            R[p].g = -2
        else:
            _insert(R, st, c, ORD - meta, bit, gv)
            R[p].g = meta - 1
        return False
    if (R[e].g & 1) == 0:
        if kind == 0:
            was = (R[e].m & bit) != 0
            R[e].m |= bit
            return was
        idx = _side_alloc(SP, st)
        SP[idx, 0] = R[e].m
        SP[idx, kind] = bit
        _insert(R, st, c, SIDE + g, idx, 0)
        R[e].g |= 1
        R[e].m |= bit
        return False
    idx = R[find(R, c, SIDE + g)].m
    was = (SP[idx, kind] & bit) != 0
    SP[idx, kind] |= bit
    R[e].m |= bit
    return was


@njit(inline="always")
def _drop_group(R: Any, st: Any, c: Any, p: Any, e: Any, o: Any) -> None:
    """Remove group entry ``e`` (ordinal ``o``) of chain ``c``, keeping ordinals dense."""
    if o < 0:
        _delete(R, st, p)
        return
    ng = -np.int64(R[p].g)
    if o != ng - 1:  # the last ordinal takes the freed one (moved as a whole by later deletions)
        q = find(R, c, ORD + ng - 1)
        R[e].m = R[q].m
        R[e].g = R[q].g
        _delete(R, st, q)
    else:
        _delete(R, st, e)
    ng -= 1
    p = find(R, c, PRIMARY)
    if ng == 1:
        q = find(R, c, ORD)
        R[p].m = R[q].m
        R[p].g = R[q].g
        _delete(R, st, q)
    else:
        R[p].g = -ng


@njit(inline="always")
def _clear(R: Any, SP: Any, st: Any, c: Any, g: Any, bit: Any, kind: Any) -> Any:
    """Clear ``bit`` of group ``g`` for chain ``c`` in ``kind``.  Returns whether it was set."""
    p, e, o = _locate(R, c, g)
    if e < 0:
        return False
    if (R[e].g & 1) == 0:
        if kind != 0 or (R[e].m & bit) == 0:
            return False
        R[e].m &= ~bit
        left = R[e].m
    else:
        s = find(R, c, SIDE + g)
        idx = R[s].m
        if (SP[idx, kind] & bit) == 0:
            return False
        SP[idx, kind] &= ~bit
        left = SP[idx, 0] | SP[idx, 1] | SP[idx, 2] | SP[idx, 3]
        R[e].m = left
        if (SP[idx, 1] | SP[idx, 2] | SP[idx, 3]) == 0:  # all GPU again: the side row goes
            R[e].g = (R[e].g >> 1) << 1
            SP[idx, 0] = st[1]
            st[1] = idx
            st[3] -= 1
            _delete(R, st, s)
            p, e, o = _locate(R, c, g)
    if left == 0:
        _drop_group(R, st, c, p, e, o)
    return True


@njit(cache=True)
def ct_set(R: Any, SP: Any, st: Any, chains: Any, g: Any, bit: Any, kind: Any) -> Any:
    """Set the bit for every chain, in order; ``out[i]``: it was already set (a further reference)."""
    out = np.zeros(len(chains), dtype=np.bool_)
    for i in range(len(chains)):
        out[i] = _set(R, SP, st, chains[i], g, bit, kind)
    return out


@njit(cache=True)
def ct_store_chained(
    R: Any, SP: Any, st: Any, E: Any, content: Any, prev: Any, engines: Any, g: Any, bit: Any, kind: Any
) -> Any:  # fmt: skip
    """One stored event in one call: chain ``content`` (block content hashes) after ``prev`` in place, set
    the slot's bit for each chain, map each engine hash to its chain in the source's engine table ``E``.
    Returns (a flag per block: the bit was already set, engine hashes that were new)."""
    n = len(content)
    c = prev
    for i in range(n):
        c = c * _P + np.uint64(content[i])
        content[i] = np.int64(c)
    # Touch every block's home bucket first: independent loads overlap their cache misses, and the
    # updates below then find their lines in cache.
    cap = len(R)
    ecap = len(E)
    acc = 0
    for i in range(n):
        acc += R[home(content[i], cap)].t + E[home(engines[i], ecap)].o
    held = np.zeros(n, dtype=np.bool_)
    for i in range(n):
        held[i] = _set(R, SP, st, content[i], g, bit, kind)
    if acc < 0:  # never: keeps the touching loads from being optimised away
        held[0] = True
    return held, et_put_inline(E, engines, content)


@njit(cache=True)
def ct_clear(R: Any, SP: Any, st: Any, chains: Any, g: Any, bit: Any, kind: Any) -> Any:
    """Clear the bit for every chain; ``out[i]``: it was set."""
    out = np.zeros(len(chains), dtype=np.bool_)
    for i in range(len(chains)):
        out[i] = _clear(R, SP, st, chains[i], g, bit, kind)
    return out


@njit(inline="always")
def kinds_of(R: Any, SP: Any, c: Any, g: Any, bit: Any) -> Any:
    """The kinds in which the slot holds chain ``c``: bit k set for kind k."""
    e = _locate(R, c, g)[1]
    if e < 0 or (R[e].m & bit) == 0:
        return 0
    if (R[e].g & 1) == 0:
        return 1
    idx = R[find(R, c, SIDE + g)].m
    f = 0
    for k in range(KINDS):
        if SP[idx, k] & bit:
            f |= 1 << k
    return f


@njit(cache=True)
def ct_kinds(R: Any, SP: Any, chains: Any, g: Any, bit: Any) -> Any:
    """Per chain, the kinds in which the slot holds it: bit k set for kind k."""
    out = np.zeros(len(chains), dtype=np.uint8)
    for i in range(len(chains)):
        out[i] = kinds_of(R, SP, chains[i], g, bit)
    return out


@njit(cache=True)
def ct_contains(R: Any, c: Any) -> Any:
    return find(R, c, PRIMARY) >= 0


@njit(cache=True)
def ct_dump(R: Any, SP: Any, with_kind: Any) -> Any:
    """Rows ``[slot, chain, kind]``, one per (slot, chain, kind) held: of kind ``with_kind``, or of every
    kind but speculative when it is -1."""
    cap = len(R)
    total = 0
    out = np.empty((0, 3), dtype=np.int64)
    for step in range(2):
        if step == 1:
            out = np.empty((total, 3), dtype=np.int64)
            total = 0
        for i in range(cap):
            t = np.int64(R[i].t)
            ge = np.int64(R[i].g)
            if t == 0 or t >= SIDE or (t == PRIMARY and ge < 0):
                continue
            g = ge >> 1
            c = R[i].k
            for kind in range(KINDS):
                if kind != with_kind and (with_kind >= 0 or kind == SPECULATIVE):
                    continue
                m = R[i].m if kind == 0 else 0
                if ge & 1:
                    m = SP[R[find(R, c, SIDE + g)].m, kind]
                rest = np.uint64(m)
                while rest:
                    low = rest & (~rest + np.uint64(1))
                    rest ^= low
                    if step == 1:
                        out[total, 0] = g * GROUP + low_bit_index(low)
                        out[total, 1] = c
                        out[total, 2] = kind
                    total += 1
    return out


@njit(cache=True)
def ct_rehash(R: Any, R2: Any) -> None:
    cap2 = len(R2)
    for i in range(len(R)):
        if R[i].t == 0:
            continue
        j = home(R[i].k, cap2)
        while R2[j].t != 0:
            j += 1
            if j == cap2:
                j = 0
        R2[j] = R[i]


class ChainTable:
    """The buckets, their capacity and growth; the kernels do the rest."""

    def __init__(self, capacity: int = 1024) -> None:
        self.R = np.zeros(capacity, dtype=BUCKET)
        self.SP = np.zeros((64, KINDS), dtype=np.int64)
        # entries used, free side-row list head, side rows ever used, side rows in use
        self.st = np.array([0, -1, 0, 0], dtype=np.int64)

    def __len__(self) -> int:
        return int(self.st[0])

    def reserve(self, n: int) -> None:
        """Room for ``n`` more chains: setting one may add a primary and two ordinals, or a side row."""
        need = int(self.st[0]) + 3 * n
        cap = len(self.R)
        if need > cap * CHAIN_LOAD:
            R2 = np.zeros(grown(cap, need, CHAIN_GROWTH, CHAIN_LOAD), dtype=BUCKET)
            ct_rehash(self.R, R2)
            self.R = R2
        if int(self.st[2]) + n > len(self.SP):
            rows = len(self.SP)
            while int(self.st[2]) + n > rows:
                rows *= 2
            SP2 = np.zeros((rows, KINDS), dtype=np.int64)
            SP2[: len(self.SP)] = self.SP
            self.SP = SP2

    def presize(self, entries: int) -> None:
        """Capacity for ``entries`` (about one per chain held) at ``PRESIZED_LOAD``, if it has less."""
        cap = int(entries / PRESIZED_LOAD) + 1024
        if cap > len(self.R):
            R2 = np.zeros(cap, dtype=BUCKET)
            ct_rehash(self.R, R2)
            self.R = R2

    def set(self, chains: I64, g: int, bit: int, kind: int) -> npt.NDArray[np.bool_]:
        self.reserve(len(chains))
        return ct_set(self.R, self.SP, self.st, chains, g, bit, kind)

    def clear(self, chains: I64, g: int, bit: int, kind: int) -> npt.NDArray[np.bool_]:
        return ct_clear(self.R, self.SP, self.st, chains, g, bit, kind)

    def kinds(self, chains: I64, g: int, bit: int) -> npt.NDArray[np.uint8]:
        return ct_kinds(self.R, self.SP, chains, g, bit)

    def contains(self, chain: int) -> bool:
        return bool(ct_contains(self.R, chain))

    def dump(self, kind: int = -1) -> I64:
        return ct_dump(self.R, self.SP, kind)

    def nbytes(self) -> int:
        return int(self.R.nbytes + self.SP.nbytes)
