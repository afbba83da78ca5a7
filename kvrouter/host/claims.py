"""Placement claims between the workers of one host: a burst of one new prompt, spread by the kernel over
several worker processes, goes to one target, as one process would send it.

::

    worker k: new prefix ─▶ decide T ─▶ claim(chain, T) under the host's lock
        a live claim for chain names U ─▶ U (k follows: the prompt is expected there, decided again)
        none ─▶ (chain, T, now + ttl) written ─▶ T
    table int64 [slots, 3]: chain hash, target slot + 1 (0: empty), expiry (float64 bits)

Why: each worker sees the others' speculative entries only once they dispatched and it pulled the rings,
so two workers deciding at the same moment both saw the prompt as new and placed it by their own view,
on different targets when their views differed (one gateway with 2 workers split paced bursts of 8).
Router replicas sharing Redis claim there instead (``replicas.PrefixClaims``), for every worker of every
replica; this is for a host that has no replicas.  A claim lives as long as a speculative entry.  The
table probes ``PROBES`` slots from the chain's own; when every one holds a live claim of another prompt,
nothing is claimed (the local view decides, counted ``full``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
from prometheus_client import CollectorRegistry, Counter

from indexer.hashing import I64Array

from ..routing.new_placements import ClaimAnswer
from ..types import TargetKey
from .memory import HostMemory

PROBES = 8
OUTCOMES = ("won", "followed", "full")


class HostClaims:
    """``pipeline.PlacementClaims`` over the host's shared memory (``claims`` view)."""

    tells_placements = False
    """Answers never list other workers' placements (``newer``): those come through the rings."""

    def __init__(
        self,
        mem: HostMemory,
        ttl_s: float,
        *,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        self.mem = mem
        self.ttl_s = ttl_s
        self.clock = clock
        self._table = mem.view("claims")
        self._expiry = self._table[:, 2:3].view(np.float64)[:, 0]
        self.outcomes: dict[str, int] = dict.fromkeys(OUTCOMES, 0)
        """This worker's claims by outcome (``/health``; the host's sum in ``/metrics``)."""
        self._counter = Counter(
            "kvrouter_host_prefix_claims",
            "Placements of a prompt no target held, claimed among the workers of this host (no router "
            "replicas): won (this worker's claim, or another's that agrees), followed (another worker's, "
            "naming another target), full (no free slot: placed on the worker's own view)",
            ["outcome"],
            registry=registry,
        )
        self._by = {o: self._counter.labels(outcome=o) for o in OUTCOMES}

    async def claim(self, chain: int, target: str, chains: I64Array, *, look: bool = True) -> ClaimAnswer:
        """The target of the live claim for ``chain``, else ``target`` now claimed (``look``: unused, no
        placements are listed)."""
        slot = self.mem.targets.slot(target) + 1  # before the lock: the directory takes it too
        owner = self.take(chain, slot, self.clock())
        if owner is None:
            self._count("full")
            return ClaimAnswer(owner=TargetKey(target))
        self._count("won" if owner == slot else "followed")
        name = self.mem.targets.name(owner - 1)
        return ClaimAnswer(owner=TargetKey(name if name is not None else target))

    def _count(self, outcome: str) -> None:
        self.outcomes[outcome] += 1
        self._by[outcome].inc()

    def take(self, chain: int, slot: int, now: float) -> int | None:
        """The live claim's target slot + 1 for ``chain``, else ``slot`` after claiming it; None when no
        probed slot is free."""
        t, exp = self._table, self._expiry
        n = len(t)
        free = -1
        with self.mem.lock:
            for i in range(PROBES):
                j = (chain + i) % n
                if t[j, 1] != 0 and exp[j] > now:
                    if t[j, 0] == chain:
                        return int(t[j, 1])
                elif free < 0:
                    free = j
            if free < 0:
                return None
            t[free, 0] = chain
            t[free, 1] = slot
            exp[free] = now + self.ttl_s
            return slot
