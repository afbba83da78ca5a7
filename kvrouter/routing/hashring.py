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

from .types import InstanceId


def stable_hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class HashRing:
    def __init__(self, instances: Iterable[InstanceId] = (), *, vnodes: int = 160) -> None:
        self.vnodes = vnodes
        self._points: list[int] = []
        self._owners: list[InstanceId] = []
        self._members: set[InstanceId] = set()
        for inst in instances:
            self.add(inst)

    @property
    def members(self) -> frozenset[InstanceId]:
        return frozenset(self._members)

    def add(self, inst: InstanceId) -> None:
        if inst in self._members:
            return
        self._members.add(inst)
        for v in range(self.vnodes):
            p = stable_hash64(f"{inst}#{v}".encode())
            i = bisect.bisect(self._points, p)
            self._points.insert(i, p)
            self._owners.insert(i, inst)

    def remove(self, inst: InstanceId) -> None:
        if inst not in self._members:
            return
        self._members.discard(inst)
        keep = [(p, o) for p, o in zip(self._points, self._owners) if o != inst]
        self._points = [p for p, _ in keep]
        self._owners = [o for _, o in keep]

    def walk(self, key: bytes) -> list[InstanceId]:
        """Distinct instances in ring order from the key's point."""
        if not self._points:
            return []
        start = bisect.bisect(self._points, stable_hash64(key))
        seen: list[InstanceId] = []
        n = len(self._points)
        for k in range(n):
            o = self._owners[(start + k) % n]
            if o not in seen:
                seen.append(o)
                if len(seen) == len(self._members):
                    break
        return seen

    def choose(
        self,
        key: bytes,
        load: Callable[[InstanceId], float],
        *,
        bound: float = 1.25,
        eligible: Callable[[InstanceId], bool] = lambda _: True,
    ) -> InstanceId | None:
        """The first eligible instance clockwise whose load is below the bounded-load capacity."""
        order = [i for i in self.walk(key) if eligible(i)]
        if not order:
            return None
        total = sum(load(i) for i in order)
        cap = math.ceil(bound * (total + 1) / len(order))
        for inst in order:
            if load(inst) < cap:
                return inst
        return min(order, key=load)
