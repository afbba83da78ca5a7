"""One source's engine hashes (vLLM's block ids) -> our chain hashes, in an open-addressing table.

One array of packed buckets: key, value, and an occupancy byte (so every 64-bit key is valid), 17 bytes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
from numba import njit

from .probing import MAX_LOAD, grown, home, stays

I64 = npt.NDArray[np.int64]
BUCKET = np.dtype([("k", "<i8"), ("v", "<i8"), ("o", "u1")])


@njit(inline="always")
def efind(E: Any, k: Any) -> Any:
    """The key's bucket, or -(bucket it would take + 1)."""
    cap = len(E)
    i = home(k, cap)
    while E[i].o:
        if E[i].k == k:
            return i
        i += 1
        if i == cap:
            i = 0
    return -(i + 1)


@njit(inline="always")
def et_put_inline(E: Any, keys: Any, vals: Any) -> Any:
    """Map each key to its value (a later one wins); returns how many keys were new."""
    added = 0
    for n in range(len(keys)):
        i = efind(E, keys[n])
        if i < 0:
            i = -i - 1
            E[i].k = keys[n]
            E[i].o = 1
            added += 1
        E[i].v = vals[n]
    return added


@njit(cache=True)
def et_put(E: Any, keys: Any, vals: Any) -> Any:
    return et_put_inline(E, keys, vals)


@njit(cache=True)
def et_get_one(E: Any, key: Any) -> tuple[bool, Any]:
    i = efind(E, key)
    return (True, E[i].v) if i >= 0 else (False, 0)


@njit(cache=True)
def et_get(E: Any, keys: Any, out: Any) -> Any:
    """``out[i]`` = value of ``keys[i]``; returns a mask of the keys found."""
    found = np.zeros(len(keys), dtype=np.bool_)
    for n in range(len(keys)):
        i = efind(E, keys[n])
        if i >= 0:
            out[n] = E[i].v
            found[n] = True
    return found


@njit(inline="always")
def et_del_at(E: Any, i: Any) -> None:
    """Empty bucket ``i`` (moves later entries of its probe run back)."""
    cap = len(E)
    j = i
    while True:
        j += 1
        if j == cap:
            j = 0
        if not E[j].o:
            break
        if not stays(i, home(E[j].k, cap), j):
            E[i].k = E[j].k
            E[i].v = E[j].v
            i = j
    E[i].o = 0


@njit(cache=True)
def et_del(E: Any, keys: Any) -> Any:
    """Remove the keys; returns how many were present."""
    gone = 0
    for n in range(len(keys)):
        i = efind(E, keys[n])
        if i >= 0:
            et_del_at(E, i)
            gone += 1
    return gone


@njit(cache=True)
def et_rehash(E: Any, E2: Any) -> None:
    cap2 = len(E2)
    for i in range(len(E)):
        if not E[i].o:
            continue
        j = home(E[i].k, cap2)
        while E2[j].o:
            j += 1
            if j == cap2:
                j = 0
        E2[j].k = E[i].k
        E2[j].v = E[i].v
        E2[j].o = 1


class EngineTable:
    """One source's engine hashes -> chain hashes."""

    __slots__ = ("E", "count")

    def __init__(self, capacity: int = 16) -> None:
        self.E = np.zeros(capacity, dtype=BUCKET)
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def put(self, keys: I64, vals: I64) -> None:
        self.reserve(len(keys))
        self.count += int(et_put(self.E, keys, vals))

    def get(self, keys: I64) -> tuple[I64, npt.NDArray[np.bool_]]:
        out = np.empty(len(keys), dtype=np.int64)
        found = et_get(self.E, keys, out)
        return out, found

    def get_one(self, key: int) -> int | None:
        found, v = et_get_one(self.E, key)
        return int(v) if found else None

    def reserve(self, n: int) -> None:
        """Room for ``n`` more keys."""
        need = self.count + n
        cap = len(self.E)
        if need > cap * MAX_LOAD:
            E2 = np.zeros(grown(cap, need), dtype=BUCKET)
            et_rehash(self.E, E2)
            self.E = E2

    def discard(self, keys: I64) -> None:
        if len(keys):
            self.count -= int(et_del(self.E, keys))

    def items(self) -> tuple[I64, I64]:
        occ = self.E["o"] != 0
        return self.E["k"][occ], self.E["v"][occ]

    def nbytes(self) -> int:
        return int(self.E.nbytes)
