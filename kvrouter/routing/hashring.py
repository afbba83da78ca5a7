"""Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam, 2018), SageMaker-style.

::

        key ──hash──▶ ·            each instance owns `vnodes` points on a 64-bit ring;
      ┌──────────────┼─────────┐   a key goes to the first point clockwise whose instance is below
      │ a   b    a   ▼  c   b  │   its capacity ceil(bound x (total load + 1) / n); past it, on to
      └────────────────────────┘   the next point: affinity is kept until an instance is full.

Adding or removing an instance moves only the keys of its own arcs (stable membership).  Hashes are
blake2b-derived, so every router replica and restart agrees on the ring.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Callable, Iterable

from ..types import TargetKey


def stable_hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


# Instance ids held by cached walks before the cache starts over: ~8 MB of references.  A fleet of 64
# targets at 160 points each needs ~650k to cache every point; 256 targets would need 10M.
_MAX_CACHED_IDS = 1 << 20


class HashRing:
    def __init__(self, instances: Iterable[TargetKey] = (), *, vnodes: int = 160) -> None:
        self.vnodes = vnodes
        self._points: list[int] = []
        self._owners: list[TargetKey] = []
        self._members: set[TargetKey] = set()
        # start index -> distinct owners in ring order from there.  A walk depends only on where the key
        # lands and on the membership, so it is computed once per point (at most vnodes x members of
        # them) and dropped when membership changes; without it every request walked ~20-100 points.
        self._orders: dict[int, tuple[TargetKey, ...]] = {}
        self._cached_ids = 0  # sum of the cached walks' lengths, bounded by _MAX_CACHED_IDS
        self._peak = 0  # the most targets prune() was offered at once
        for inst in instances:
            self.add(inst)

    @property
    def members(self) -> frozenset[TargetKey]:
        return frozenset(self._members)

    def add(self, inst: TargetKey) -> None:
        if inst in self._members:
            return
        self._members.add(inst)
        self._forget_walks()
        for v in range(self.vnodes):
            p = stable_hash64(f"{inst}#{v}".encode())
            i = bisect.bisect(self._points, p)
            self._points.insert(i, p)
            self._owners.insert(i, inst)

    def remove(self, inst: TargetKey) -> None:
        self.retain(m for m in self._members if m != inst)

    def retain(self, keep: Iterable[str]) -> None:
        """Drop every member not in ``keep``.  A member's points depend only on its name, so one dropped
        and added again later owns exactly the arcs it had."""
        keep = set(keep)
        gone = [m for m in self._members if m not in keep]
        if not gone:
            return
        self._members.difference_update(gone)
        self._forget_walks()
        kept = [(p, o) for p, o in zip(self._points, self._owners) if o in self._members]
        self._points = [p for p, _ in kept]
        self._owners = [o for _, o in kept]

    def prune(self, current: Iterable[str], *, slack: int = 4) -> None:
        """Members only ever join as the policies meet new targets; under churn (a Kubernetes rollout
        renames every pod) the ring would grow without end, and every uncached walk scans until it has
        seen all members.  Once it holds more than twice the most targets ever offered at once (plus
        ``slack``), drop the ones not among the current targets.  Routing is unchanged: absent members
        were skipped anyway, and a busy target left out of ``current`` comes back with the same arcs.
        Measured against the peak, not the current count, so a fleet at capacity (few targets offered)
        does not prune and re-add its busy members on every request."""
        current = set(current)
        self._peak = max(self._peak, len(current))
        if len(self._members) > 2 * self._peak + slack:
            self.retain(current)

    def walk(self, key: bytes) -> tuple[TargetKey, ...]:
        """Distinct instances in ring order from the key's point."""
        if not self._points:
            return ()
        start = bisect.bisect(self._points, stable_hash64(key))
        order = self._orders.get(start)
        if order is None:
            order = self._walk_from(start)
            self._cached_ids += len(order)
            if self._cached_ids > _MAX_CACHED_IDS:  # a large fleet: points x members can reach ~100 MB
                self._forget_walks()
                self._cached_ids = len(order)
            self._orders[start] = order
        return order

    def _forget_walks(self) -> None:
        self._orders.clear()
        self._cached_ids = 0

    def _walk_from(self, start: int) -> tuple[TargetKey, ...]:
        seen: dict[TargetKey, None] = {}
        n, want = len(self._points), len(self._members)
        for k in range(n):
            seen.setdefault(self._owners[(start + k) % n])
            if len(seen) == want:
                break
        return tuple(seen)

    def choose(
        self,
        key: bytes,
        load: Callable[[TargetKey], float],
        *,
        bound: float = 1.25,
        eligible: Callable[[TargetKey], bool] = lambda _: True,
        order: Iterable[TargetKey] | None = None,
    ) -> TargetKey | None:
        """The first eligible instance clockwise whose load is below the bounded-load capacity.
        ``order``: ``walk(key)`` when the caller has it already."""
        cands = [i for i in (self.walk(key) if order is None else order) if eligible(i)]
        if not cands:
            return None
        total = sum(load(i) for i in cands)
        cap = math.ceil(bound * (total + 1) / len(cands))
        for inst in cands:
            if load(inst) < cap:
                return inst
        return min(cands, key=load)
