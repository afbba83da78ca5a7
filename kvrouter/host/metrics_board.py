"""Where the workers of one host leave their metrics for whichever of them is scraped.

::

    counters[1]                    scrape generation: bumped by a worker that is being scraped
    metric_heads[k] = [answered generation, seq, length, live, ...]           written by worker k only
    metric_bytes[k] = worker k's last snapshot (``metric_merge.Snapshot``, msgpack)

    scraped worker:  ask() ─▶ generation g ─▶ (the shell wakes the others) ─▶ wait until every live
                     worker answered g ─▶ read every row ─▶ merge
    every worker:    on a wake-up: publish(own snapshot) ─▶ answered = g

A row is a seqlock: ``seq`` is odd while its writer copies, so a reader that sees it change (or odd)
reads again and never merges half a snapshot.  A row outlives its worker: a crashed worker's last
snapshot is what the host shows for it until its replacement (which starts from it) answers.
"""

from __future__ import annotations

import numpy as np

from .memory import HostMemory

_GEN, _SEQ, _LEN, _LIVE = range(4)


class SnapshotTooLarge(Exception):
    """A worker's snapshot does not fit its row (``HostLayout.metric_bytes``)."""


class MetricsBoard:
    def __init__(self, mem: HostMemory, me: int) -> None:
        self.mem = mem
        self.me = me
        self._counters = mem.view("counters")
        self._heads = mem.view("metric_heads")
        self._bytes = mem.view("metric_bytes")
        self.capacity = self._bytes.shape[1]

    # ------------------------------------------------------------------ own row
    def set_live(self, live: bool) -> None:
        self._heads[self.me, _LIVE] = 1 if live else 0

    def publish(self, data: bytes, generation: int | None = None) -> None:
        """Write this worker's snapshot; ``generation``: the scrape it answers."""
        n = len(data)
        if n > self.capacity:
            raise SnapshotTooLarge(f"{n} bytes; a worker's row holds {self.capacity}")
        h = self._heads[self.me]
        h[_SEQ] += 1  # odd: being written
        self._bytes[self.me, :n] = np.frombuffer(data, dtype=np.uint8)
        h[_LEN] = n
        h[_SEQ] += 1
        if generation is not None:
            h[_GEN] = max(int(h[_GEN]), generation)

    # ------------------------------------------------------------------ the scrape
    def generation(self) -> int:
        return int(self._counters[1])

    def ask(self) -> int:
        """A new scrape generation (every live worker is to answer it)."""
        with self.mem.lock:
            self._counters[1] += 1
            return int(self._counters[1])

    def pending(self, generation: int) -> list[int]:
        """Live workers (other than this one) that have not answered ``generation`` yet."""
        h = self._heads
        return [k for k in range(len(h)) if k != self.me and h[k, _LIVE] and int(h[k, _GEN]) < generation]

    def read(self, k: int, tries: int = 10_000) -> bytes | None:
        """Worker ``k``'s last snapshot (None: it never wrote one, or kept writing through every try)."""
        h = self._heads[k]
        for _ in range(tries):
            s1 = int(h[_SEQ])
            if s1 & 1:
                continue
            n = int(h[_LEN])
            data = self._bytes[k, :n].tobytes()
            if int(h[_SEQ]) == s1:
                return data if n else None
        return None

    def clear_row(self, k: int) -> None:
        """Worker ``k`` died: not live (its last snapshot stays, for its replacement to start from)."""
        self._heads[k, _LIVE] = 0
