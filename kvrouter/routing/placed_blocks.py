"""Blocks of new prompts placed on each target lately: the placement band's balance key.

::

    a new prompt (no target held its first block) sent to T, by this router, by another worker of its
    host (``HostSync.pull``) or, through the claims log, by another replica
        ──add(T, blocks, now)──▶ per target: (time, blocks) of the last ``window_s``, in time order
    before a decision: blocks(T, now) ──▶ their sum

    the target's cache emptied (``Indexer.clears`` moved on: AllBlocksCleared, an engine restart)
        ──cleared(T, clears, now)──▶ T's log dropped; adds dated before ``now`` ignored

Why not the cache footprint alone: under cache pressure every target's footprint stands at its capacity
(evictions keep it there), so "footprint above the fleet's mean" no longer tells which cache took the
last prompts and the ring order alone decides, piling them up.  What was placed keeps counting for the
window whatever the caches evict since.  An emptied cache is another matter: nothing placed there before
is held, and a prompt placed since stands on an empty cache (a fleet whose caches are reset between
workloads would otherwise place the next by the last one's shares).  Invariant: ``blocks(T, now)`` is
the sum of the blocks added for T at times in (max(now - window_s, T's last clear), now].
"""

from __future__ import annotations

import math
from collections import deque

import msgspec

from indexer import SourceKey

from ..types import TargetKey

PLACEMENT_WINDOW_S = 30.0
"""How long a placement counts: long enough to span the first placements of a workload's prompts (which
decide where each stays), short enough that a target's share follows the traffic of the last minute."""


class HostPlacement(msgspec.Struct, frozen=True, gc=False):
    """A new prompt another worker process of this host placed at ``source`` (without router replicas
    placements are shared between workers this way; with them, through the claims log)."""

    source: SourceKey
    blocks: int
    now: float


class PlacedBlocks:
    def __init__(self, window_s: float = PLACEMENT_WINDOW_S) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        self.window_s = window_s
        self._log: dict[TargetKey, deque[tuple[float, int]]] = {}
        self._sum: dict[TargetKey, int] = {}
        self._clears: dict[TargetKey, tuple[int, float]] = {}
        """Per target: the index's clear count last seen, and when this router saw it move."""

    def cleared(self, target: TargetKey, clears: int, now: float) -> None:
        """The index has emptied ``target``'s cache ``clears`` times: if that moved since the last call,
        what was placed there until ``now`` is forgotten (it is no longer held)."""
        seen, _ = self._clears.get(target, (0, -math.inf))
        if clears == seen:
            return
        self._clears[target] = (clears, now)
        log = self._log.get(target)
        while log and log[0][0] < now:
            self._sum[target] -= log.popleft()[1]

    def add(self, target: TargetKey, blocks: int, now: float) -> None:
        if blocks <= 0:
            return
        if now < self._clears.get(target, (0, -math.inf))[1]:  # placed before its cache was emptied
            return
        log = self._log.setdefault(target, deque())
        i = len(log)
        while i and log[i - 1][0] > now:  # another worker's, a little older than ours: kept in order
            i -= 1
        log.insert(i, (now, blocks))
        self._sum[target] = self._sum.get(target, 0) + blocks

    def blocks(self, target: TargetKey, now: float) -> int:
        log = self._log.get(target)
        if not log:
            return 0
        edge = now - self.window_s
        total = self._sum[target]
        while log and log[0][0] <= edge:
            total -= log.popleft()[1]
        self._sum[target] = total
        return total
