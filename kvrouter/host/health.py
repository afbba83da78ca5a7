"""Health and ejections shared by the workers of one host: every worker routes around the same instances.

::

    record per instance (float64): [set, healthy, failures, ejections, ejected_until, last_ejection]
    counters[0]: version, bumped by every write: a worker re-reads the records only when it moved

Writes (a failed request in any worker, the leader's active checks) are read-modify-write under the
host's lock, so two workers' failures both count toward ``failure_threshold``.  A record not ``set`` yet
(an instance some worker added before the checking worker saw it) leaves a worker's own view as it is.
"""

from __future__ import annotations

from typing import Protocol

from .memory import HostLock, HostMemory

_SET, _HEALTHY, _FAILURES, _EJECTIONS, _UNTIL, _LAST = range(6)


class HealthState(Protocol):
    """The fields of ``gateway.upstream.Upstream`` that the host shares."""

    @property
    def name(self) -> str: ...

    healthy: bool
    failures: int
    ejections: int
    ejected_until: float
    last_ejection: float


class HealthBoard:
    def __init__(self, mem: HostMemory) -> None:
        self.mem = mem
        self._rec = mem.view("health")
        self._counters = mem.view("counters")

    @property
    def lock(self) -> HostLock:
        return self.mem.lock

    def version(self) -> int:
        return int(self._counters[0])

    def pull(self, u: HealthState) -> bool:
        """Copy the shared record into ``u`` (if one was written); True if ``u.healthy`` changed."""
        slot = self.mem.instances.find(u.name)
        if slot is None:
            return False
        r = self._rec[slot].tolist()
        if not r[_SET]:
            return False
        was = u.healthy
        u.healthy = bool(r[_HEALTHY])
        u.failures, u.ejections = int(r[_FAILURES]), int(r[_EJECTIONS])
        u.ejected_until, u.last_ejection = r[_UNTIL], r[_LAST]
        return u.healthy != was

    def push(self, u: HealthState) -> None:
        """Write ``u``'s state as the host's (call under ``lock`` when it was read-modify-write)."""
        slot = self.mem.instances.slot(u.name)
        self._rec[slot] = (1.0, float(u.healthy), u.failures, u.ejections, u.ejected_until, u.last_ejection)
        self._counters[0] += 1

    def failures(self, name: str) -> int:
        slot = self.mem.instances.find(name)
        return 0 if slot is None else int(self._rec[slot, _FAILURES])
