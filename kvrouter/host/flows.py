"""The flows' accounts and rate buckets for the whole host: every worker's queue charges and lifts the same
counters, sees every worker's backlog, and takes from the same buckets.

::

    flow_names    SlotDirectory: "f:<priority>:<tenant>"  a flow's account
                                 "v:<priority>"           a priority's virtual time
                                 "r:<tenant>"             a tenant's rate buckets
                                 "q:<tenant>"             what a tenant was let through
    flow_epoch    int64 [3]            [slots freed how many times | charges so far | flows forgotten]
    flow_accounts float64 [slots, 4]   f: [counter (without external) | last charged at (a charge count)
                                           | served here | external]
                                       v: [- | virtual time | - | -]   r: the four rate-bucket words
                                       q: [requests | tokens | - | -]
    flow_waiting  int64 [workers, slots]   waiters of each flow, per worker (written by that worker only)

A flow's counter is its own column plus ``external``: the service other router replicas gave it, written
by the worker that syncs with them (``kvrouter.replicas.flows``); "served here" and ``q:`` are what this
host tells them.

Counters and buckets change under the host's lock (a charge reads, then writes: two workers charging at
once must not lose one).  When a new flow (or any new name) finds the directory full, the least recently
charged sixteenth of the flows without waiters in any worker is forgotten (their slots freed, the epoch
moved): as in ``flows.LocalAccounts``, each comes back as a new flow.  A write to a flow's row checks,
under the lock, that no slot was freed since it looked the row up.  Only when every flow has waiters
does a new one share the overflow account, its share counted with every other such flow's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ..flows import Buckets, Flow
from .memory import HostMemory, SlotsExhausted

OVERFLOW = "overflow"


class HostFlows:
    """``flows.FlowAccounts`` and ``flows.BucketStore`` over a ``HostMemory``, as worker ``me``."""

    def __init__(self, mem: HostMemory, me: int) -> None:
        self.mem = mem
        self.me = me
        self._acc = mem.view("flow_accounts")
        self._waiting = mem.view("flow_waiting")
        self._epoch = mem.view("flow_epoch")
        self._overflow = mem.flows.slot(OVERFLOW)
        self._flows: dict[int, Flow | None] = {}
        self._flows_epoch = 0

    @property
    def forgotten(self) -> int:
        """Flows forgotten so far, by every worker (``kvrouter_flow_accounts_forgotten_total``)."""
        return int(self._epoch[2])

    def census(self) -> tuple[int, int] | None:
        """The host's, reported by worker 0 alone (the metrics' merge would count it once per worker)."""
        if self.me != 0:
            return None
        return sum(1 for name, _ in self.mem.flows.items() if name.startswith("f:")), self.forgotten

    def slot(self, name: str) -> int:
        """The slot of ``name``, made room for by forgetting idle flows when the table is full (the names
        that keep their slots, a priority's virtual time, a tenant's buckets or counts, a queue's group,
        are sized for by ``serve``: ``supervisor.shared_host``); the overflow slot when none can be."""
        try:
            return self.mem.flows.slot(name, self._reclaim)
        except SlotsExhausted:
            return self._overflow

    def flow_slot(self, flow: Flow) -> int:
        return self.slot(f"f:{flow.priority}:{flow.tenant}")

    def _reclaim(self) -> list[int]:
        """Under the lock, the directory full: the least recently charged sixteenth of the flows without
        waiters in any worker, their rows cleared."""
        idle = [
            s for name, s in self.mem.flows.items() if name.startswith("f:") and not self._waiting[:, s].any()
        ]
        idle.sort(key=lambda s: float(self._acc[s, 1]))
        out = idle[: max(1, len(idle) // 16)] if idle else []
        self._acc[out] = 0.0
        self._epoch[2] += len(out)
        return out

    def _row(self, flow: Flow, write: Callable[[int], None]) -> None:
        """``write(slot)`` under the lock, with ``flow``'s slot as it is then (looked up again if a slot
        was freed between the lookup and the lock)."""
        while True:
            seen = self.mem.flows.epoch()
            s = self.flow_slot(flow)
            with self.mem.lock:
                if self.mem.flows.epoch() == seen:
                    write(s)
                    return

    def flow_at(self, slot: int) -> Flow | None:
        """The flow whose account ``slot`` is (None: a virtual time, buckets or the overflow)."""
        epoch = self.mem.flows.epoch()
        if epoch != self._flows_epoch:
            self._flows, self._flows_epoch = {}, epoch
        if slot not in self._flows:
            name = self.mem.flows.name(slot) or ""
            kind, _, rest = name.partition(":")
            prio, _, tenant = rest.partition(":")
            self._flows[slot] = Flow(tenant, int(prio)) if kind == "f" and tenant else None
        return self._flows[slot]

    # ------------------------------------------------------------------ FlowAccounts
    def _counter(self, s: int) -> float:
        return float(self._acc[s, 0] + self._acc[s, 3])

    def counter(self, flow: Flow) -> float:
        return self._counter(self.flow_slot(flow))

    def lift(self, flow: Flow, own_waiting: Mapping[Flow, int]) -> float:
        backlogged = (self._waiting.sum(axis=0) > 0).nonzero()[0].tolist()
        peers = [
            self._counter(s)
            for s in backlogged
            if (f := self.flow_at(s)) is not None and f.priority == flow.priority
        ]
        base = min(peers) if peers else float(self._acc[self.slot(f"v:{flow.priority}"), 1])
        return max(self.counter(flow), base)

    def set_counter(self, flow: Flow, value: float) -> None:
        def write(s: int) -> None:
            self._acc[s, 0] = value - self._acc[s, 3]
            self._acc[s, 1] = self._epoch[1]

        self._row(flow, write)

    def charge(self, flow: Flow, amount: float) -> None:
        v = self.slot(f"v:{flow.priority}")

        def write(s: int) -> None:
            self._acc[v, 1] = max(float(self._acc[v, 1]), self._counter(s))
            self._acc[s, 0] += amount
            self._acc[s, 2] += amount
            self._epoch[1] += 1
            self._acc[s, 1] = self._epoch[1]

        self._row(flow, write)

    def _flow_slots(self) -> list[tuple[Flow, int]]:
        return [(f, s) for _, s in self.mem.flows.items() if (f := self.flow_at(s)) is not None]

    def served(self) -> dict[Flow, float]:
        return {f: float(self._acc[s, 2]) for f, s in self._flow_slots() if self._acc[s, 2]}

    def set_external(self, service: Mapping[Flow, float]) -> None:
        for f, s in self._flow_slots():
            self._acc[s, 3] = service.get(f, 0.0)

    def served_changed(self) -> dict[Flow, float] | None:
        return None  # charged by every worker: not tracked here (the host's flow slots are bounded)

    def set_waiting(self, flow: Flow, n: int) -> None:
        def write(s: int) -> None:
            self._waiting[self.me, s] = n

        self._row(flow, write)

    def waiting(self, flow: Flow, own: int) -> int:
        return max(own, int(self._waiting[:, self.flow_slot(flow)].sum()))

    def clear_row(self, worker: int) -> None:
        """A worker that died waits for nothing."""
        self._waiting[worker] = 0

    # ------------------------------------------------------------------ BucketStore
    def update(self, tenant: str, fn: Callable[[Buckets], float]) -> float:
        s = self.slot(f"r:{tenant}")
        with self.mem.lock:
            row = self._acc[s]
            b = row.tolist()
            if b == [0.0, 0.0, 0.0, 0.0]:
                b = [0.0, -1.0, 0.0, -1.0]  # never used
            out = fn(b)
            row[:] = b
        return out

    def count(self, tenant: str, requests: float, tokens: float) -> None:
        s = self.slot(f"q:{tenant}")
        with self.mem.lock:
            self._acc[s, 0] += requests
            self._acc[s, 1] += tokens

    def counted(self) -> dict[str, tuple[float, float]]:
        return {
            name[2:]: (float(self._acc[s, 0]), float(self._acc[s, 1]))
            for name, s in self.mem.flows.items()
            if name.startswith("q:")
        }
