"""Speculative entries shared by the workers of one host: one ring per worker, written by that worker only.

::

    worker k dispatches ──▶ Indexer.speculative_outbox ──push──▶ rings[k]   (head advanced after the data)
    worker j routes     ──pull──▶ every rings[k != j] from its cursor to the head ──▶ its own index

    record (int64 words): [words, instance slot, dp rank, now (float64 bits), flags, n, chain_0 .. chain_n-1]
    flags: bit 0 set for an entry another router replica made (the leader's round trip took it in);
           bit 1 set for a placement record: n = 1, its one word the blocks of a new prompt the writer
           placed at (instance, rank) (``push_placed``: the band's balance key, ``routing.placed_blocks``)
    a record that would cross the ring's end is preceded by a wrap word (-1) and starts at offset 0

A reader more than a ring behind (a writer that lapped it) jumps to the head and counts the entries it lost:
a lost speculative entry only makes one routing decision less informed, never wrong about a cache.  The
entry keeps its origin's ``now`` (one monotonic clock per host), so it expires in every worker at once.
"""

from __future__ import annotations

import msgspec
import numpy as np

from indexer import SourceKey
from indexer.indexer import SpeculativeEntry

from .memory import HostMemory

_HEADER = 6
_WRAP = -1
_FROM_REPLICA = 1
_PLACED = 2
_NO_CHAINS = np.empty(0, dtype=np.int64)


class PeerEntry(msgspec.Struct, gc=False):
    source: SourceKey
    chains: np.ndarray
    now: float
    from_replica: bool = False
    """Made by another router replica (not by a worker of this host): its blocks count as that replica's
    queued prefill here (``routing.PeerPrefill``)."""
    placed: int = 0
    """A placement record (``chains`` empty): the blocks of a new prompt another worker placed at
    ``source``, which count in that target's share of new placements here too."""


class SpeculativeRings:
    def __init__(self, mem: HostMemory, me: int) -> None:
        self.mem = mem
        self.me = me
        self._rings = mem.view("rings")
        self._heads = mem.view("ring_heads")[:, 0]
        self.size = mem.layout.ring_words
        self._cursor = [int(h) for h in self._heads]
        self.lost = 0
        """Entries of other workers this one never applied (lapped, or too large for a ring)."""

    # ------------------------------------------------------------------ writing (own ring)
    def push(self, entries: list[SpeculativeEntry], *, from_replica: bool = False) -> None:
        flags = _FROM_REPLICA if from_replica else 0
        for e in entries:
            self._write(e.source, e.chains, e.now, flags)

    def push_placed(self, source: SourceKey, blocks: int, now: float) -> None:
        """This worker placed a new prompt of ``blocks`` blocks at ``source``: the others count it too."""
        self._write(source, np.array([blocks], dtype=np.int64), now, _PLACED)

    def _write(self, source: SourceKey, data: np.ndarray, now: float, flags: int) -> None:
        ring, size = self._rings[self.me], self.size
        head = int(self._heads[self.me])
        n = len(data)
        words = _HEADER + n
        if words > size:
            self.lost += 1
            return
        pos = head % size
        if pos + words > size:
            ring[pos] = _WRAP
            head += size - pos
            pos = 0
        ring[pos] = words
        ring[pos + 1] = self.mem.instances.slot(source.instance)
        ring[pos + 2] = source.dp_rank
        ring[pos + 3 : pos + 4] = np.array([now], dtype=np.float64).view(np.int64)
        ring[pos + 4] = flags
        ring[pos + 5] = n
        ring[pos + _HEADER : pos + words] = data
        self._heads[self.me] = head + words  # after the data: a reader never reads a record being written

    # ------------------------------------------------------------------ reading (every other ring)
    def pull(self) -> list[PeerEntry]:
        out: list[PeerEntry] = []
        for k in range(len(self._cursor)):
            if k != self.me and self._cursor[k] != int(self._heads[k]):
                self._read(k, out)
        return out

    def _read(self, k: int, out: list[PeerEntry]) -> None:
        ring, size = self._rings[k], self.size
        head = int(self._heads[k])
        cur = self._cursor[k]
        if head - cur > size:
            self.lost += 1
            self._cursor[k] = head
            return
        start = len(out)
        while cur < head:
            pos = cur % size
            words = int(ring[pos])
            if words == _WRAP:
                cur += size - pos
                continue
            if words < _HEADER or pos + words > size:
                break  # overwritten under us: checked below
            inst = self.mem.instances.name(int(ring[pos + 1]))
            now = float(ring[pos + 3 : pos + 4].view(np.float64)[0])
            flags = int(ring[pos + 4])
            n = int(ring[pos + 5])
            if inst is not None and n == words - _HEADER:
                src = SourceKey(inst, int(ring[pos + 2]))
                if flags & _PLACED:
                    if n == 1:
                        out.append(PeerEntry(src, _NO_CHAINS, now, placed=int(ring[pos + _HEADER])))
                else:
                    chains = ring[pos + _HEADER : pos + words].copy()
                    out.append(PeerEntry(src, chains, now, bool(flags & _FROM_REPLICA)))
            cur += words
        if int(self._heads[k]) - self._cursor[k] > size:
            # The writer came round while we read: what we copied may be half new; drop this batch.
            self.lost += len(out) - start
            del out[start:]
            cur = int(self._heads[k])
        self._cursor[k] = max(cur, head)
