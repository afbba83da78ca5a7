"""The load rows of a host's workers: what ``routing.LoadTracker`` reads and writes through when several
worker processes route for one host.

::

    worker k:  dispatch / first token / finish ──▶ loads[k, slot] += (in flight, prefilling, prefill
                                                                       tokens, decoding)   (own row only)
    any:       observe_engine ──▶ engine[slot]       set_external ──▶ external[slot]
    routing:   totals() = loads.sum(over workers), engine, external  ──▶ one view, the same in every worker

A worker's row is written by that worker alone, so no lock is taken on the request path; a reader may see
another worker's request counted in ``in_flight`` a moment before its prefill tokens (both are words of
their own), never a torn number.  A worker that dies leaves its row behind: ``clear_row`` drops it when
the supervisor starts the replacement (its requests died with it).
"""

from __future__ import annotations

import math

import numpy as np

from ..types import TargetKey
from .memory import HostMemory

IN_FLIGHT, PREFILLING, PREFILL_TOKENS, DECODING = range(4)


class HostLoads:
    """``routing.load.SharedLoads`` over a ``HostMemory``, as worker ``me``."""

    def __init__(self, mem: HostMemory, me: int) -> None:
        if not 0 <= me < mem.layout.workers:
            raise ValueError(f"worker {me} of {mem.layout.workers}")
        self.mem = mem
        self.me = me
        self._loads = mem.view("loads")
        self._own = self._loads[me]
        self._engine = mem.view("engine")
        self._external = mem.view("external")

    def slot(self, key: TargetKey) -> int:
        return self.mem.targets.slot(key)

    def slots(self) -> list[tuple[TargetKey, int]]:
        return [(TargetKey(k), s) for k, s in self.mem.targets.items()]

    def add(self, slot: int, in_flight: int, prefilling: int, prefill_tokens: int, decoding: int) -> None:
        row = self._own[slot]
        row[IN_FLIGHT] += in_flight
        row[PREFILLING] += prefilling
        row[PREFILL_TOKENS] += prefill_tokens
        row[DECODING] += decoding

    def claim(self, slot: int, cap: int) -> bool:
        # Under the lock against the other workers' claims.  Their lock-free in-flight writes are finishes
        # (which only lower the sum) and dispatches nothing capped them for.
        with self.mem.lock:
            if int(self._loads[:, slot, IN_FLIGHT].sum()) + int(self._external[slot, 0]) >= cap:
                return False
            self._own[slot, IN_FLIGHT] += 1
            return True

    def totals(self) -> np.ndarray:
        """[targets, 4] summed over every worker's row."""
        return self._loads.sum(axis=0)

    def read(self, slots: list[int]) -> list[tuple[list[int], list[float], list[int]]]:
        """For each slot: (the 4 counts summed over workers, engine [running, waiting, seen_at, kv usage],
        external [in flight, prefill tokens]), in one pass over the rows."""
        counts = self._loads[:, slots].sum(axis=0).tolist()
        return list(zip(counts, self._engine[slots].tolist(), self._external[slots].tolist(), strict=True))

    def set_engine(
        self, slot: int, running: int, waiting: int, seen_at: float, kv_usage: float = 0.0
    ) -> None:
        e = self._engine[slot]
        e[0], e[1], e[2], e[3] = running, waiting, seen_at, kv_usage

    def engine(self, slot: int) -> tuple[int, int, float | None]:
        r, w, at, _ = self._engine[slot]
        return int(r), int(w), None if at == 0 or math.isnan(at) else float(at)

    def set_external(self, slot: int, in_flight: int, prefill_tokens: int) -> None:
        e = self._external[slot]
        e[0], e[1] = in_flight, prefill_tokens

    def external(self, slot: int) -> tuple[int, int]:
        n, t = self._external[slot]
        return int(n), int(t)

    def clear_row(self, worker: int) -> None:
        """A worker is gone (and with it every request it held): its row counts nothing any more."""
        self._loads[worker] = 0
