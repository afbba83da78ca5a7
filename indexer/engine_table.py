"""One source's engine hashes (vLLM's block ids) -> our chain hashes, in an open-addressing table.

Three arrays: keys, values, and an occupancy byte (so every 64-bit key is valid): 17 bytes an entry.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
from numba import njit

from .probing import MAX_LOAD, grown, home, stays

I64 = npt.NDArray[np.int64]


@njit(inline="always")
def _efind(EK: Any, EO: Any, k: Any) -> Any:
    """The key's bucket, or -(bucket it would take + 1)."""
    cap = len(EK)
    i = home(k, cap)
    while EO[i]:
        if EK[i] == k:
            return i
        i += 1
        if i == cap:
            i = 0
    return -(i + 1)


@njit(cache=True)
def et_put(EK: Any, EV: Any, EO: Any, keys: Any, vals: Any) -> Any:
    """Map each key to its value (a later one wins); returns how many keys were new."""
    added = 0
    for n in range(len(keys)):
        i = _efind(EK, EO, keys[n])
        if i < 0:
            i = -i - 1
            EK[i] = keys[n]
            EO[i] = 1
            added += 1
        EV[i] = vals[n]
    return added


@njit(cache=True)
def et_get(EK: Any, EV: Any, EO: Any, keys: Any, out: Any) -> Any:
    """``out[i]`` = value of ``keys[i]``; returns a mask of the keys found."""
    found = np.zeros(len(keys), dtype=np.bool_)
    for n in range(len(keys)):
        i = _efind(EK, EO, keys[n])
        if i >= 0:
            out[n] = EV[i]
            found[n] = True
    return found


@njit(cache=True)
def et_del(EK: Any, EV: Any, EO: Any, keys: Any) -> Any:
    """Remove the keys; returns how many were present."""
    cap = len(EK)
    gone = 0
    for n in range(len(keys)):
        i = _efind(EK, EO, keys[n])
        if i < 0:
            continue
        gone += 1
        j = i
        while True:
            j += 1
            if j == cap:
                j = 0
            if not EO[j]:
                break
            if not stays(i, home(EK[j], cap), j):
                EK[i] = EK[j]
                EV[i] = EV[j]
                i = j
        EO[i] = 0
    return gone


@njit(cache=True)
def et_rehash(EK: Any, EV: Any, EO: Any, EK2: Any, EV2: Any, EO2: Any) -> None:
    cap2 = len(EK2)
    for i in range(len(EK)):
        if not EO[i]:
            continue
        j = home(EK[i], cap2)
        while EO2[j]:
            j += 1
            if j == cap2:
                j = 0
        EK2[j] = EK[i]
        EV2[j] = EV[i]
        EO2[j] = 1


class EngineTable:
    """One source's engine hashes -> chain hashes."""

    __slots__ = ("EK", "EO", "EV", "n")

    def __init__(self, capacity: int = 16) -> None:
        self.EK = np.zeros(capacity, dtype=np.int64)
        self.EV = np.zeros(capacity, dtype=np.int64)
        self.EO = np.zeros(capacity, dtype=np.uint8)
        self.n = 0

    def __len__(self) -> int:
        return self.n

    def put(self, keys: I64, vals: I64) -> None:
        need = self.n + len(keys)
        cap = len(self.EK)
        if need > cap * MAX_LOAD:
            new = grown(cap, need)
            EK2 = np.zeros(new, dtype=np.int64)
            EV2 = np.zeros(new, dtype=np.int64)
            EO2 = np.zeros(new, dtype=np.uint8)
            et_rehash(self.EK, self.EV, self.EO, EK2, EV2, EO2)
            self.EK, self.EV, self.EO = EK2, EV2, EO2
        self.n += int(et_put(self.EK, self.EV, self.EO, keys, vals))

    def get(self, keys: I64) -> tuple[I64, npt.NDArray[np.bool_]]:
        out = np.empty(len(keys), dtype=np.int64)
        found = et_get(self.EK, self.EV, self.EO, keys, out)
        return out, found

    def get_one(self, key: int) -> int | None:
        out = np.empty(1, dtype=np.int64)
        if et_get(self.EK, self.EV, self.EO, np.array([key], dtype=np.int64), out)[0]:
            return int(out[0])
        return None

    def discard(self, keys: I64) -> None:
        if len(keys):
            self.n -= int(et_del(self.EK, self.EV, self.EO, keys))

    def items(self) -> tuple[I64, I64]:
        occ = self.EO.view(np.bool_)
        return self.EK[occ], self.EV[occ]

    def nbytes(self) -> int:
        return int(self.EK.nbytes + self.EV.nbytes + self.EO.nbytes)
