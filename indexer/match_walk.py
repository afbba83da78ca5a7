"""The lookup's walk over the chain table (``indexer.chain_table``): matched depth per source.

::

    chains[0] ──groups──▶ alive[g] = mask                      (the groups holding the first block)
    chains[k] ──groups──▶ alive[g] &= mask_k[g]  ──lost bits──▶ those slots matched k blocks
    stop at the first block nobody holds, or when no group is alive

Each step reads the block's groups from one probe run and touches only the groups still alive, so a
lookup costs the matched depth times the groups holding those blocks, whatever the size of the fleet.
From a token array the walk hashes each block as it goes (``match_tokens``): blocks past the first one
nobody holds are never hashed.
"""

from __future__ import annotations

from typing import Any

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
def _emit(out: Any, r: Any, slot: Any, depth: Any) -> None:
    out[r, 0] = slot
    out[r, 1] = depth
    out[r, 2] = 0
    out[r, 3] = 0
    out[r, 4] = 0


@njit(cache=True)
def _walk(
    R: Any, SP: Any, chains: Any, n_given: Any, tokens: Any, bs: Any, prev: Any,
    n_groups: Any,
) -> Any:  # fmt: skip
    """Rows ``[slot, depth, cpu, storage, speculative]`` of every slot matching >= 1 leading block, by
    increasing depth.
    ``chains[:n_given]`` are given; later ones are hashed from ``tokens`` (blocks of ``bs``) after
    ``prev``.  Each block counts once, in its best kind (GPU first); GPU = depth - the others."""
    n = len(chains)
    alive = np.zeros(n_groups, dtype=np.int64)
    act = np.empty(n_groups, dtype=np.int64)
    gs = np.empty(n_groups, dtype=np.int64)
    ms = np.empty(n_groups, dtype=np.int64)
    cur = np.zeros(n_groups, dtype=np.int64)
    side_at = np.zeros(n, dtype=np.bool_)
    out = np.empty((n_groups * GROUP, 5), dtype=np.int64)  # rows, in the order of their depth
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
        if k == 0:
            for t in range(nt):
                alive[gs[t]] = ms[t]
                act[t] = gs[t]
            nact = nt
        else:
            for t in range(nt):
                cur[gs[t]] = ms[t]
            j = 0
            for t in range(nact):
                g = act[t]
                a = alive[g]
                new = a & cur[g]
                lost = np.uint64(a ^ new)
                while lost:
                    low = lost & (~lost + np.uint64(1))
                    _emit(out, nr, g * GROUP + low_bit_index(low), k)
                    nr += 1
                    lost ^= low
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
            _emit(out, nr, g * GROUP + low_bit_index(low), k)
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


def match_chains(R: Any, SP: Any, chains: Any, n_groups: int) -> Any:
    if not len(chains) or not n_groups:
        return np.zeros((0, 5), dtype=np.int64)
    return _walk(R, SP, chains, len(chains), _NO_TOKENS, 1, np.uint64(0), n_groups)


def match_tokens(R: Any, SP: Any, tokens: Any, block_size: int, prev: int, n_groups: int) -> Any:
    """``tokens``: a contiguous array of checked token ids; ``prev``: the chain base."""
    n = len(tokens) // block_size
    if not n or not n_groups:
        return np.zeros((0, 5), dtype=np.int64)
    chains = np.empty(n, dtype=np.int64)
    return _walk(R, SP, chains, 0, tokens, block_size, np.uint64(prev & ((1 << 64) - 1)), n_groups)
