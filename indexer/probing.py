"""What the index's open-addressing tables share: where a key lives, how tables grow, bit tricks.

Linear probing with backward-shift deletion (no tombstones).  A key's home bucket is a 64-bit mix of it
scaled onto the capacity, so capacities need not be powers of two and tables grow by ``GROWTH`` (memory
per entry matters more here than a probe or two).  Kernels are compiled with numba and work on plain
numpy arrays.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
from numba import njit

MAX_LOAD = 0.85
GROWTH = 1.25
SMALL = 4096  # tables below this many buckets double instead (a source's table starts small)

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S27, _S30, _S31, _S32, _S58 = (np.uint64(s) for s in (27, 30, 31, 32, 58))
_DEBRUIJN = np.uint64(0x03F79D71B4CB0A89)


def _debruijn_table() -> npt.NDArray[np.int64]:
    t = np.zeros(64, dtype=np.int64)
    for i in range(64):
        t[(((1 << i) * 0x03F79D71B4CB0A89) & ((1 << 64) - 1)) >> 58] = i
    t.setflags(write=False)
    return t


_CTZ = _debruijn_table()


@njit(inline="always")
def home(k: Any, cap: Any) -> Any:
    """The home bucket of key ``k`` (splitmix64's finaliser, then scaled onto ``cap`` < 2**32)."""
    h = np.uint64(k)
    h = (h ^ (h >> _S30)) * _M1
    h = (h ^ (h >> _S27)) * _M2
    h = h ^ (h >> _S31)
    return np.int64(((h >> _S32) * np.uint64(cap)) >> _S32)


@njit(inline="always")
def stays(i: Any, h: Any, j: Any) -> Any:
    """Backward shift: may the entry at ``j``, whose home is ``h``, stay when bucket ``i`` empties?  It
    stays iff its home lies cyclically in (i, j]."""
    return (i < h <= j) if i <= j else (h > i or h <= j)


@njit(inline="always")
def low_bit_index(low: Any) -> Any:
    """Index of the single set bit of ``low`` (a uint64 power of two)."""
    return _CTZ[np.int64((low * _DEBRUIJN) >> _S58)]


def grown(cap: int, need: int, growth: float = GROWTH, max_load: float = MAX_LOAD) -> int:
    """The capacity that holds ``need`` entries under ``max_load``, growing ``cap`` by ``growth`` steps
    (doubling while below ``SMALL``)."""
    while need > cap * max_load:
        cap = 2 * cap if cap < SMALL else int(cap * growth) + 8
    return cap
