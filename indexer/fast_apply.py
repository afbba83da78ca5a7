"""Applying one payload's parsed events (``fast_wire``) to the index's tables: one compiled call.

For one source (slot ``bit`` of group ``g``), each row in order, exactly as ``BlockIndex`` does::

    STORED   chain the blocks after the parent's chain (engine table) or 0, set the bit in the medium,
             map each engine hash to its chain                          (BlockIndex.store_content)
    LINK     each engine hash's chain from the engine table (unknown counted), bit set   (store, offloads)
    REMOVED  per engine hash: unknown or not held is counted; else clear the bit, and drop the engine id
             once no medium holds it                                    (BlockIndex.remove)
    NOOP     nothing (a stored event without blocks)

Invariant: the call stops before the first row the Python path must take, having changed nothing for it
(a stored event with an unknown parent, one that could take the source past its cap, a removal while the
slot may hold references beyond the first).  ``ingest`` parses and applies in one call when the tables
have room for the whole payload; otherwise the caller grows them (only the owner reallocates a table).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from .chain_table import CHAIN_LOAD, _clear, _set, kinds_of
from .engine_table import efind, et_del_at, et_put_inline
from .fast_wire import ACCEPTED, LINK, REMOVED, STORED, parse_batch
from .probing import MAX_LOAD, home

_P = np.uint64(0x9E3779B97F4A7C15)  # the chain multiplier of ``indexer.hashing``
_MEDIA_KINDS = 0b111

# out[...]: what the call did, for the caller's counts and counters
ENGINES_ADDED = 0
ENGINES_REMOVED = 1
NEW = 2  # 2, 3, 4: chains newly held per medium
CLEARED = 5  # 5, 6, 7: chains no longer held per medium
UNKNOWN_REMOVED = 8
UNKNOWN_LINKED = 9
HELD = 10  # blocks stored again (a further reference: the caller records it)
OFFLOAD_ROWS = 11  # rows applied that feed an offload tier (stored in CPU/disk, or linked): counted apart
OUT = 12

# ingest's status, beside fast_wire's ACCEPTED / DECLINED / GROW
NEED_ROOM = 2  # parsed, nothing applied: grow the tables, then ``apply_rows``
WRONG_SOURCE = 3  # parsed, nothing applied: the batch names another rank than the one assumed

# flags[block]
ALREADY_HELD = 1
UNKNOWN = 2


@njit(inline="always")
def _remove(
    R: Any, SP: Any, st: Any, E: Any, engines: Any, lo: Any, hi: Any, g: Any, bit: Any, m: Any,
    stop_held: Any, counts: Any, out: Any,
) -> Any:  # fmt: skip
    """Drop one reference per engine hash of ``engines[lo:hi]``, in order.  With ``stop_held``, stops at
    the first hash the slot holds in ``m`` (a further reference may exist: the caller decides); returns
    where it stopped (``hi`` when done)."""
    # Touch each hash's engine bucket, then its chain's home bucket, before the updates: independent loads
    # overlap their cache misses (the updates then find their lines in cache).
    cap = len(R)
    ecap = len(E)
    acc = 0
    for k in range(lo, hi):
        acc += E[home(engines[k], ecap)].o
    for k in range(lo, hi):
        j = efind(E, engines[k])
        if j >= 0:
            acc += R[home(E[j].v, cap)].t
    if acc < 0:  # never (tags and flags are >= 0): keeps the touching loads
        return lo
    for k in range(lo, hi):
        j = efind(E, engines[k])
        if j < 0:
            out[UNKNOWN_REMOVED] += 1
            continue
        c = E[j].v
        f = kinds_of(R, SP, c, g, bit)
        if (f & (1 << m)) == 0:
            out[UNKNOWN_REMOVED] += 1
            continue
        if stop_held:
            return k
        _clear(R, SP, st, c, g, bit, m)
        out[CLEARED + m] += 1
        counts[m] -= 1
        if (f & (_MEDIA_KINDS & ~(1 << m))) == 0:
            et_del_at(E, j)
            out[ENGINES_REMOVED] += 1
    return hi


@njit(cache=True, nogil=True)
def remove_hashes(
    R: Any, SP: Any, st: Any, E: Any, engines: Any, lo: Any, hi: Any, g: Any, bit: Any, m: Any,
    stop_held: Any, counts: Any, out: Any,
) -> Any:  # fmt: skip
    """``BlockIndex.remove`` in one call (see ``_remove``); ``counts``: the slot's chains per medium."""
    return _remove(R, SP, st, E, engines, lo, hi, g, bit, m, stop_held, counts, out)


@njit(cache=True, nogil=True)
def apply_rows(
    R: Any, SP: Any, st: Any, E: Any, rows: Any, n_rows: Any, engines: Any, blocks: Any, flags: Any,
    g: Any, bit: Any, extra_refs: Any, counts: Any, max_blocks: Any, out: Any,
) -> Any:  # fmt: skip
    """Apply rows ``0 .. n_rows-1``; returns the index of the first row not applied (``n_rows`` if all).
    Stored and linked rows leave each block's chain in ``blocks`` and its flag in ``flags``; ``counts``
    (the slot's chains per medium) follows, and may not pass ``max_blocks``."""
    out[:] = 0
    cap = len(R)
    for i in range(n_rows):
        kind = rows[i, 0]
        m = rows[i, 1]
        nb = rows[i, 2]
        eo = rows[i, 3]
        bo = rows[i, 6]
        if (kind in (STORED, LINK)) and counts[m] + nb > max_blocks:
            return i
        if kind == STORED:
            c = np.uint64(0)
            if rows[i, 4]:
                j = efind(E, rows[i, 5])
                if j < 0:
                    return i
                c = np.uint64(E[j].v)
            ecap = len(E)
            acc = 0
            for k in range(nb):
                c = c * _P + np.uint64(blocks[bo + k])
                blocks[bo + k] = np.int64(c)
                # touch the home buckets first: independent loads overlap their cache misses
                acc += R[home(blocks[bo + k], cap)].t + E[home(engines[eo + k], ecap)].o
            for k in range(nb):
                was = _set(R, SP, st, blocks[bo + k], g, bit, m)
                flags[bo + k] = ALREADY_HELD if was else 0
                out[HELD if was else NEW + m] += 1
                counts[m] += 0 if was else 1
            out[ENGINES_ADDED] += et_put_inline(E, engines[eo : eo + nb], blocks[bo : bo + nb])
            out[OFFLOAD_ROWS] += m != 0
            if acc < 0:  # never (tags and flags are >= 0): keeps the touching loads
                return -1
        elif kind == LINK:
            out[OFFLOAD_ROWS] += 1
            for k in range(nb):
                j = efind(E, engines[eo + k])
                if j < 0:
                    flags[bo + k] = UNKNOWN
                    out[UNKNOWN_LINKED] += 1
                    continue
                blocks[bo + k] = E[j].v
                was = _set(R, SP, st, E[j].v, g, bit, m)
                flags[bo + k] = ALREADY_HELD if was else 0
                out[HELD if was else NEW + m] += 1
                counts[m] += 0 if was else 1
        elif kind == REMOVED:
            if extra_refs or out[HELD]:
                return i
            _remove(R, SP, st, E, engines, eo, eo + nb, g, bit, m, False, counts, out)
    return n_rows


@njit(cache=True, nogil=True)
def ingest(
    buf: Any, block_size: Any, rows: Any, engines: Any, blocks: Any, flags: Any,
    R: Any, SP: Any, st: Any, E: Any, e_used: Any, g: Any, bit: Any, rank: Any, extra_refs: Any,
    counts: Any, max_blocks: Any, out: Any,
) -> tuple[Any, Any, Any, Any, Any, Any]:  # fmt: skip
    """``parse_batch`` then ``apply_rows`` for the source assumed to have rank ``rank`` (-2: whatever the
    batch says), when both tables have room for the whole payload (``e_used``: the engine table's keys).
    Returns (status, events, ts, the batch's rank, blocks, rows applied)."""
    status, n_ev, ts, r, nb = parse_batch(buf, block_size, rows, engines, blocks)
    if status != ACCEPTED:
        return status, n_ev, ts, r, nb, 0
    if rank != -2 and r >= 0 and r != rank:
        return WRONG_SOURCE, n_ev, ts, r, nb, 0
    # (the growth conditions of ChainTable.reserve and EngineTable.reserve)
    if st[0] + 3 * nb > len(R) * CHAIN_LOAD or st[2] + nb > len(SP) or e_used + nb > len(E) * MAX_LOAD:
        return NEED_ROOM, n_ev, ts, r, nb, 0
    done = apply_rows(
        R, SP, st, E, rows, n_ev, engines, blocks, flags, g, bit, extra_refs, counts, max_blocks, out
    )
    return ACCEPTED, n_ev, ts, r, nb, done
