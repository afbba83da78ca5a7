"""The fleet's chain table: which groups of 64 sources hold each chain hash, in which kinds.

One open-addressing table (``indexer.probing``) with four kinds of entry, told apart by their tag::

    (chain, PRIMARY)    group g inline: mask of g's slots holding the chain    | or -ng: the chain is held
    (chain, ORD + o)    the o-th of its ng groups, with that group's mask      |  by ng >= 2 groups
    (chain, SIDE + g)   row of SP: per-kind masks [gpu, cpu, storage, speculative] of group g, present
                        only while some slot of g holds the chain in a kind other than GPU

Every entry of a chain has the chain's home bucket, so a chain's groups sit in one probe run: a lookup
reads them in one pass over adjacent buckets.  A group entry's mask is the OR of its kinds' masks;
without a side row all its bits are GPU.

Invariants
* a chain has a PRIMARY entry iff some slot holds it in some kind; a group's mask is never 0;
* a group entry's side flag (bit 0 of ``G``) is set iff its SIDE row exists, and the row's
  cpu | storage | speculative part is then not 0;
* ordinals of a chain's groups are exactly 0 .. ng-1, and ng >= 2 (a chain left with one group goes back
  inline).

Tag 0 marks an empty bucket, so any 64-bit chain hash is a valid key.  Arrays: 20 bytes an entry.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
from numba import njit

from .probing import MAX_LOAD, grown, home, low_bit_index, stays

GROUP = 64
MAX_GROUPS = 16_382
"""Groups of 64 sources one table tells apart (tags and group fields are int16)."""
KINDS = 4  # GPU, CPU, STORAGE, speculative
SPECULATIVE = 3
PRIMARY = 1
ORD = 2
SIDE = ORD + MAX_GROUPS

I64 = npt.NDArray[np.int64]


@njit(inline="always")
def find(K: Any, T: Any, k: Any, tag: Any) -> Any:
    cap = len(K)
    i = home(k, cap)
    while True:
        t = T[i]
        if t == 0:
            return -1
        if t == tag and K[i] == k:
            return i
        i += 1
        if i == cap:
            i = 0


@njit(inline="always")
def _insert(K: Any, T: Any, M: Any, G: Any, st: Any, k: Any, tag: Any, m: Any, g: Any) -> Any:
    """Add an entry known to be absent (never moves another entry)."""
    cap = len(K)
    i = home(k, cap)
    while T[i] != 0:
        i += 1
        if i == cap:
            i = 0
    K[i] = k
    T[i] = tag
    M[i] = m
    G[i] = g
    st[0] += 1
    return i


@njit(cache=True)
def _delete(K: Any, T: Any, M: Any, G: Any, st: Any, i: Any) -> None:
    """Empty bucket ``i`` (moves later entries of its probe run back)."""
    cap = len(K)
    j = i
    while True:
        j += 1
        if j == cap:
            j = 0
        if T[j] == 0:
            break
        if not stays(i, home(K[j], cap), j):
            K[i] = K[j]
            T[i] = T[j]
            M[i] = M[j]
            G[i] = G[j]
            i = j
    T[i] = 0
    st[0] -= 1


@njit(inline="always")
def _locate(K: Any, T: Any, G: Any, c: Any, g: Any) -> tuple[Any, Any, Any]:
    """(primary, group entry, ordinal) of chain ``c`` in group ``g``, -1 if absent (ordinal -1: inline)."""
    p = find(K, T, c, PRIMARY)
    if p < 0:
        return -1, -1, -1
    meta = np.int64(G[p])
    if meta >= 0:
        if (meta >> 1) == g:
            return p, p, -1
        return p, -1, -1
    for o in range(-meta):
        q = find(K, T, c, ORD + o)
        if (np.int64(G[q]) >> 1) == g:
            return p, q, o
    return p, -1, -1


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


@njit(cache=True)
def _set(K: Any, T: Any, M: Any, G: Any, SP: Any, st: Any, c: Any, g: Any, bit: Any, kind: Any) -> Any:
    """Set ``bit`` of group ``g`` for chain ``c`` in ``kind``.  Returns whether it was already set."""
    p, e, _ = _locate(K, T, G, c, g)
    if e < 0:
        gv = g << 1
        if kind != 0:
            idx = _side_alloc(SP, st)
            SP[idx, kind] = bit
            _insert(K, T, M, G, st, c, SIDE + g, idx, 0)
            gv |= 1
        if p < 0:
            _insert(K, T, M, G, st, c, PRIMARY, bit, gv)
            return False
        meta = np.int64(G[p])
        if meta >= 0:  # inline -> two groups
            _insert(K, T, M, G, st, c, ORD, M[p], meta)
            _insert(K, T, M, G, st, c, ORD + 1, bit, gv)
            M[p] = 0
            G[p] = -2
        else:
            _insert(K, T, M, G, st, c, ORD - meta, bit, gv)
            G[p] = meta - 1
        return False
    if (G[e] & 1) == 0:
        if kind == 0:
            was = (M[e] & bit) != 0
            M[e] |= bit
            return was
        idx = _side_alloc(SP, st)
        SP[idx, 0] = M[e]
        SP[idx, kind] = bit
        _insert(K, T, M, G, st, c, SIDE + g, idx, 0)
        G[e] |= 1
        M[e] |= bit
        return False
    idx = M[find(K, T, c, SIDE + g)]
    was = (SP[idx, kind] & bit) != 0
    SP[idx, kind] |= bit
    M[e] |= bit
    return was


@njit(cache=True)
def _drop_group(K: Any, T: Any, M: Any, G: Any, st: Any, c: Any, p: Any, e: Any, o: Any) -> None:
    """Remove group entry ``e`` (ordinal ``o``) of chain ``c``, keeping ordinals dense."""
    if o < 0:
        _delete(K, T, M, G, st, p)
        return
    ng = -np.int64(G[p])
    if o != ng - 1:  # the last ordinal takes the freed one (moved as a whole by later deletions)
        q = find(K, T, c, ORD + ng - 1)
        M[e] = M[q]
        G[e] = G[q]
        _delete(K, T, M, G, st, q)
    else:
        _delete(K, T, M, G, st, e)
    ng -= 1
    p = find(K, T, c, PRIMARY)
    if ng == 1:
        q = find(K, T, c, ORD)
        M[p] = M[q]
        G[p] = G[q]
        _delete(K, T, M, G, st, q)
    else:
        G[p] = -ng


@njit(cache=True)
def _clear(K: Any, T: Any, M: Any, G: Any, SP: Any, st: Any, c: Any, g: Any, bit: Any, kind: Any) -> Any:
    """Clear ``bit`` of group ``g`` for chain ``c`` in ``kind``.  Returns whether it was set."""
    p, e, o = _locate(K, T, G, c, g)
    if e < 0:
        return False
    if (G[e] & 1) == 0:
        if kind != 0 or (M[e] & bit) == 0:
            return False
        M[e] &= ~bit
        left = M[e]
    else:
        s = find(K, T, c, SIDE + g)
        idx = M[s]
        if (SP[idx, kind] & bit) == 0:
            return False
        SP[idx, kind] &= ~bit
        left = SP[idx, 0] | SP[idx, 1] | SP[idx, 2] | SP[idx, 3]
        M[e] = left
        if (SP[idx, 1] | SP[idx, 2] | SP[idx, 3]) == 0:  # all GPU again: the side row goes
            G[e] = (G[e] >> 1) << 1
            SP[idx, 0] = st[1]
            st[1] = idx
            st[3] -= 1
            _delete(K, T, M, G, st, s)
            p, e, o = _locate(K, T, G, c, g)
    if left == 0:
        _drop_group(K, T, M, G, st, c, p, e, o)
    return True


@njit(cache=True)
def ct_set(K: Any, T: Any, M: Any, G: Any, SP: Any, st: Any, chains: Any, g: Any, bit: Any, kind: Any) -> Any:
    """Set the bit for every chain, in order; ``out[i]``: it was already set (a further reference)."""
    out = np.zeros(len(chains), dtype=np.bool_)
    for i in range(len(chains)):
        out[i] = _set(K, T, M, G, SP, st, chains[i], g, bit, kind)
    return out


@njit(cache=True)
def ct_clear(
    K: Any, T: Any, M: Any, G: Any, SP: Any, st: Any, chains: Any, g: Any, bit: Any, kind: Any
) -> Any:
    """Clear the bit for every chain; ``out[i]``: it was set."""
    out = np.zeros(len(chains), dtype=np.bool_)
    for i in range(len(chains)):
        out[i] = _clear(K, T, M, G, SP, st, chains[i], g, bit, kind)
    return out


@njit(cache=True)
def ct_kinds(K: Any, T: Any, M: Any, G: Any, SP: Any, chains: Any, g: Any, bit: Any) -> Any:
    """Per chain, the kinds in which the slot holds it: bit k set for kind k."""
    out = np.zeros(len(chains), dtype=np.uint8)
    for i in range(len(chains)):
        c = chains[i]
        e = _locate(K, T, G, c, g)[1]
        if e < 0 or (M[e] & bit) == 0:
            continue
        if (G[e] & 1) == 0:
            out[i] = 1
            continue
        idx = M[find(K, T, c, SIDE + g)]
        f = 0
        for k in range(KINDS):
            if SP[idx, k] & bit:
                f |= 1 << k
        out[i] = f
    return out


@njit(cache=True)
def ct_contains(K: Any, T: Any, c: Any) -> Any:
    return find(K, T, c, PRIMARY) >= 0


@njit(cache=True)
def ct_dump(K: Any, T: Any, M: Any, G: Any, SP: Any, with_kind: Any) -> Any:
    """Rows ``[slot, chain, kind]``, one per (slot, chain, kind) held: of kind ``with_kind``, or of every
    kind but speculative when it is -1."""
    cap = len(K)
    total = 0
    out = np.empty((0, 3), dtype=np.int64)
    for step in range(2):
        if step == 1:
            out = np.empty((total, 3), dtype=np.int64)
            total = 0
        for i in range(cap):
            t = np.int64(T[i])
            ge = np.int64(G[i])
            if t == 0 or t >= SIDE or (t == PRIMARY and ge < 0):
                continue
            g = ge >> 1
            c = K[i]
            for kind in range(KINDS):
                if kind != with_kind and (with_kind >= 0 or kind == SPECULATIVE):
                    continue
                m = M[i] if kind == 0 else 0
                if ge & 1:
                    m = SP[M[find(K, T, c, SIDE + g)], kind]
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
def ct_rehash(K: Any, T: Any, M: Any, G: Any, K2: Any, T2: Any, M2: Any, G2: Any) -> None:
    cap2 = len(K2)
    for i in range(len(K)):
        if T[i] == 0:
            continue
        j = home(K[i], cap2)
        while T2[j] != 0:
            j += 1
            if j == cap2:
                j = 0
        K2[j] = K[i]
        T2[j] = T[i]
        M2[j] = M[i]
        G2[j] = G[i]


class ChainTable:
    """The arrays, their capacity and growth; the kernels do the rest."""

    def __init__(self, capacity: int = 1024) -> None:
        self.K = np.zeros(capacity, dtype=np.int64)
        self.T = np.zeros(capacity, dtype=np.int16)
        self.M = np.zeros(capacity, dtype=np.int64)
        self.G = np.zeros(capacity, dtype=np.int16)
        self.SP = np.zeros((64, KINDS), dtype=np.int64)
        # entries used, free side-row list head, side rows ever used, side rows in use
        self.st = np.array([0, -1, 0, 0], dtype=np.int64)

    def __len__(self) -> int:
        return int(self.st[0])

    def reserve(self, n: int) -> None:
        """Room for ``n`` more chains: setting one may add a primary and two ordinals, or a side row."""
        need = int(self.st[0]) + 3 * n
        cap = len(self.K)
        if need > cap * MAX_LOAD:
            new = grown(cap, need)
            K2 = np.zeros(new, dtype=np.int64)
            T2 = np.zeros(new, dtype=np.int16)
            M2 = np.zeros(new, dtype=np.int64)
            G2 = np.zeros(new, dtype=np.int16)
            ct_rehash(self.K, self.T, self.M, self.G, K2, T2, M2, G2)
            self.K, self.T, self.M, self.G = K2, T2, M2, G2
        if int(self.st[2]) + n > len(self.SP):
            rows = len(self.SP)
            while int(self.st[2]) + n > rows:
                rows *= 2
            SP2 = np.zeros((rows, KINDS), dtype=np.int64)
            SP2[: len(self.SP)] = self.SP
            self.SP = SP2

    def set(self, chains: I64, g: int, bit: int, kind: int) -> npt.NDArray[np.bool_]:
        self.reserve(len(chains))
        return ct_set(self.K, self.T, self.M, self.G, self.SP, self.st, chains, g, bit, kind)

    def clear(self, chains: I64, g: int, bit: int, kind: int) -> npt.NDArray[np.bool_]:
        return ct_clear(self.K, self.T, self.M, self.G, self.SP, self.st, chains, g, bit, kind)

    def kinds(self, chains: I64, g: int, bit: int) -> npt.NDArray[np.uint8]:
        return ct_kinds(self.K, self.T, self.M, self.G, self.SP, chains, g, bit)

    def contains(self, chain: int) -> bool:
        return bool(ct_contains(self.K, self.T, chain))

    def dump(self, kind: int = -1) -> I64:
        return ct_dump(self.K, self.T, self.M, self.G, self.SP, kind)

    def nbytes(self) -> int:
        return int(self.K.nbytes + self.T.nbytes + self.M.nbytes + self.G.nbytes + self.SP.nbytes)
