"""The lookup's walk over the chain table (``indexer.chain_table``): matched depth per source.

::

    chains[0] ──groups──▶ alive[g] = mask                      (the groups holding the first block)
    chains[k] ──groups──▶ alive[g] &= mask_k[g]  ──lost bits──▶ those slots matched k blocks
    stop at the first block nobody holds, or when no group is alive

Each step touches only the groups still alive, so a lookup costs the matched depth times the groups
holding those blocks, whatever the fleet's size; ``match_tokens`` hashes as it walks, so blocks past the
first miss are never hashed.  Shared stores (``indexer.tiers``) are slots that are never reported: a block
a store holds counts for every slot attached to it, and is credited to the store in the row's column
``5 + s`` when the slot holds no copy of its own::

    alive[g] &= mask_k[g] | OR(attach[s][g] for the stores s holding block k)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from numba import njit

from .chain_table import GROUP, KINDS, PRIMARY, SIDE, find
from .hashing import block_nh
from .probing import home, low_bit_index

_P = np.uint64(0x9E3779B97F4A7C15)  # the chain multiplier of ``indexer.hashing``


@njit(inline="always")
def _groups_of(R: Any, c: Any, gs: Any, ms: Any) -> tuple[Any, Any]:
    """The groups holding chain ``c`` and their masks into ``gs``/``ms``: (count, whether one has a side
    row).  Count 0: nobody holds it.  One pass over the chain's probe run."""
    cap = len(R)
    i = home(c, cap)
    n = 0
    ng = -1
    side = False
    while R[i].t != 0:
        if R[i].k == c:
            t = R[i].t
            if t == PRIMARY:
                meta = np.int64(R[i].g)
                if meta >= 0:
                    gs[0] = meta >> 1
                    ms[0] = R[i].m
                    return 1, (meta & 1) != 0
                ng = -int(meta)
                if n == ng:
                    return n, side
            elif t < SIDE:
                gq = np.int64(R[i].g)
                gs[n] = gq >> 1
                ms[n] = R[i].m
                side |= (gq & 1) != 0
                n += 1
                if n == ng:
                    return n, side
        i += 1
        if i == cap:
            i = 0
    return (n if ng > 0 else 0), side


@njit(inline="always")
def _emit(out: Any, r: Any, slot: Any, depth: Any, shared: Any) -> None:
    out[r, 0] = slot
    out[r, 1] = depth
    out[r, 2] = 0
    out[r, 3] = 0
    out[r, 4] = 0
    for s in range(shared.shape[1]):
        out[r, 5 + s] = shared[slot, s]


@njit(inline="always")
def _credit(shared: Any, via: Any, g: Any, attach: Any, held: Any, nheld: Any) -> None:
    """Count one block for each slot of group ``g`` in ``via`` under the first store holding it that the
    slot attaches."""
    rest = np.uint64(via)
    while rest:
        low = rest & (~rest + np.uint64(1))
        rest ^= low
        m = np.int64(low)
        for h in range(nheld):
            if attach[held[h], g] & m:
                shared[g * GROUP + low_bit_index(low), held[h]] += 1
                break


@njit(cache=True)
def _walk(
    R: Any, SP: Any, chains: Any, n_given: Any, tokens: Any, bs: Any, prev: Any,
    n_groups: Any, st_slot: Any, attach: Any, keep: Any,
) -> Any:  # fmt: skip
    """Rows ``[slot, depth, cpu, storage, speculative, shared_0 ..]`` of every reported slot matching >= 1
    leading block, by increasing depth.
    ``chains[:n_given]`` are given; later ones are hashed from ``tokens`` (blocks of ``bs``) after
    ``prev``.  Each block counts once, in its best kind (GPU first, a store last); GPU = depth - the
    others.  ``st_slot``: the stores' slots, ``attach[s, g]``: the slots of group g attached to store s,
    ``keep[g]``: the slots of group g that are reported (not stores)."""
    n = len(chains)
    ns = len(st_slot)
    alive = np.zeros(n_groups, dtype=np.int64)
    act = np.empty(n_groups, dtype=np.int64)
    gs = np.empty(n_groups, dtype=np.int64)
    ms = np.empty(n_groups, dtype=np.int64)
    cur = np.zeros(n_groups, dtype=np.int64)
    ext = np.zeros(n_groups, dtype=np.int64)
    inact = np.zeros(n_groups, dtype=np.bool_)
    held = np.empty(max(ns, 1), dtype=np.int64)
    shared = np.zeros((n_groups * GROUP if ns else 0, ns), dtype=np.int64)
    side_at = np.zeros(n, dtype=np.bool_)
    out = np.empty((n_groups * GROUP, 5 + ns), dtype=np.int64)  # rows, in the order of their depth
    nr = 0
    nact = 0
    k = 0
    while k < n:
        if k >= n_given:
            prev = prev * _P + block_nh(tokens, k * bs, bs)
            chains[k] = np.int64(prev)
        nt, side = _groups_of(R, chains[k], gs, ms)
        if nt == 0:
            break
        side_at[k] = side
        nheld = 0
        for s in range(ns):
            g0 = st_slot[s] // GROUP
            b0 = np.int64(1) << np.int64(st_slot[s] % GROUP)
            for t in range(nt):
                if gs[t] == g0 and (ms[t] & b0) != 0:
                    held[nheld] = s
                    nheld += 1
                    break
        if k == 0:
            for t in range(nt):
                g = gs[t]
                alive[g] = ms[t] & keep[g]
                cur[g] = ms[t]
            for h in range(nheld):
                for g in range(n_groups):
                    alive[g] |= attach[held[h], g]
            for g in range(n_groups):
                if alive[g] != 0:
                    act[nact] = g
                    nact += 1
                    inact[g] = True
                    if nheld:
                        via = alive[g] & ~cur[g]
                        if via:
                            _credit(shared, via, g, attach, held, nheld)
            for t in range(nt):
                cur[gs[t]] = 0
        else:
            for t in range(nt):
                cur[gs[t]] = ms[t]
            if nheld:
                for t in range(nact):
                    g = act[t]
                    e = np.int64(0)
                    for h in range(nheld):
                        e |= attach[held[h], g]
                    ext[g] = e
            j = 0
            for t in range(nact):
                g = act[t]
                a = alive[g]
                new = a & (cur[g] | ext[g])
                lost = np.uint64(a ^ new)
                while lost:
                    low = lost & (~lost + np.uint64(1))
                    _emit(out, nr, g * GROUP + low_bit_index(low), k, shared)
                    nr += 1
                    lost ^= low
                if nheld:
                    via = new & ext[g] & ~cur[g]
                    if via:
                        _credit(shared, via, g, attach, held, nheld)
                    ext[g] = 0
                alive[g] = new
                if new:
                    act[j] = g
                    j += 1
            nact = j
            for t in range(nt):
                cur[gs[t]] = 0
        k += 1
        if nact == 0:
            break
    for t in range(nact):
        g = act[t]
        rest = np.uint64(alive[g])
        while rest:
            low = rest & (~rest + np.uint64(1))
            _emit(out, nr, g * GROUP + low_bit_index(low), k, shared)
            nr += 1
            rest ^= low
    out = out[:nr]
    if nr and side_at[:k].any():
        _split_tiers(R, SP, chains, side_at, k, out, n_groups)
    return out


@njit(cache=True)
def _split_tiers(R: Any, SP: Any, chains: Any, side_at: Any, deepest: Any, out: Any, n_groups: Any) -> None:
    """Count, per matched slot, the blocks whose best kind is CPU, STORAGE or speculative (only groups
    with a side row can have any)."""
    row_of = np.full(n_groups * GROUP, -1, dtype=np.int64)
    for r in range(len(out)):
        row_of[out[r, 0]] = r
    gs = np.empty(n_groups, dtype=np.int64)
    ms = np.empty(n_groups, dtype=np.int64)
    for k in range(deepest):
        if not side_at[k]:
            continue
        c = chains[k]
        nt = _groups_of(R, c, gs, ms)[0]
        for t in range(nt):
            g = gs[t]
            s = find(R, c, SIDE + g)
            if s < 0:
                continue
            idx = R[s].m
            rest = np.uint64(ms[t])
            while rest:
                low = rest & (~rest + np.uint64(1))
                rest ^= low
                r = row_of[g * GROUP + low_bit_index(low)]
                if r < 0 or out[r, 1] <= k:
                    continue
                m = np.int64(low)
                if SP[idx, 0] & m:
                    continue
                for kind in range(1, KINDS):
                    if SP[idx, kind] & m:
                        out[r, 1 + kind] += 1
                        break


_NO_TOKENS = np.zeros(0, dtype=np.uint32)
NO_STORES = np.zeros(0, dtype=np.int64)


class Shared(NamedTuple):
    """The stores' slots, their attached slots per group, the reported slots per group (``_walk``)."""

    slots: Any
    attach: Any
    keep: Any


def no_shared(n_groups: int) -> Shared:
    return Shared(NO_STORES, np.zeros((0, n_groups), dtype=np.int64), np.full(n_groups, -1, dtype=np.int64))


def match_chains(R: Any, SP: Any, chains: Any, n_groups: int, shared: Shared | None = None) -> Any:
    sh = shared if shared is not None else no_shared(n_groups)
    if not len(chains) or not n_groups:
        return np.zeros((0, 5 + len(sh.slots)), dtype=np.int64)
    return _walk(
        R, SP, chains, len(chains), _NO_TOKENS, 1, np.uint64(0), n_groups, sh.slots, sh.attach, sh.keep
    )


def match_tokens(
    R: Any, SP: Any, tokens: Any, block_size: int, prev: int, n_groups: int, shared: Shared | None = None
) -> Any:
    """``tokens``: a contiguous array of checked token ids; ``prev``: the chain base."""
    sh = shared if shared is not None else no_shared(n_groups)
    n = len(tokens) // block_size
    if not n or not n_groups:
        return np.zeros((0, 5 + len(sh.slots)), dtype=np.int64)
    chains = np.empty(n, dtype=np.int64)
    return _walk(
        R, SP, chains, 0, tokens, block_size, np.uint64(prev & ((1 << 64) - 1)), n_groups,
        sh.slots, sh.attach, sh.keep,
    )  # fmt: skip
