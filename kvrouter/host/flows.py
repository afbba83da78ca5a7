"""The flows' accounts and rate buckets for the whole host: every worker's queue charges and lifts the same
counters, sees every worker's backlog, and takes from the same buckets.

::

    flow_names    SlotDirectory: "f:<priority>:<tenant>"  a flow's account
                                 "v:<priority>"           a priority's virtual time
                                 "r:<tenant>"             a tenant's rate buckets
    flow_accounts float64 [slots, 4]   [counter | virtual time | ...] or the four rate-bucket words
    flow_waiting  int64 [workers, slots]   waiters of each flow, per worker (written by that worker only)

Counters and buckets change under the host's lock (a charge reads, then writes: two workers charging at
once must not lose one).  A flow past the directory's slots shares one overflow account: its share is
then counted with every other such flow's.
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
        self._overflow = mem.flows.slot(OVERFLOW)
        self._flows: dict[int, Flow | None] = {}

    def slot(self, name: str) -> int:
        try:
            return self.mem.flows.slot(name)
        except SlotsExhausted:
            return self._overflow

    def flow_slot(self, flow: Flow) -> int:
        return self.slot(f"f:{flow.priority}:{flow.tenant}")

    def flow_at(self, slot: int) -> Flow | None:
        """The flow whose account ``slot`` is (None: a virtual time, buckets or the overflow)."""
        if slot not in self._flows:
            name = self.mem.flows.name(slot) or ""
            kind, _, rest = name.partition(":")
            prio, _, tenant = rest.partition(":")
            self._flows[slot] = Flow(tenant, int(prio)) if kind == "f" and tenant else None
        return self._flows[slot]

    # ------------------------------------------------------------------ FlowAccounts
    def counter(self, flow: Flow) -> float:
        return float(self._acc[self.flow_slot(flow), 0])

    def lift(self, flow: Flow, own_waiting: Mapping[Flow, int]) -> float:
        backlogged = (self._waiting.sum(axis=0) > 0).nonzero()[0].tolist()
        peers = [
            float(self._acc[s, 0])
            for s in backlogged
            if (f := self.flow_at(s)) is not None and f.priority == flow.priority
        ]
        base = min(peers) if peers else float(self._acc[self.slot(f"v:{flow.priority}"), 1])
        return max(self.counter(flow), base)

    def set_counter(self, flow: Flow, value: float) -> None:
        self._acc[self.flow_slot(flow), 0] = value

    def charge(self, flow: Flow, amount: float) -> None:
        s, v = self.flow_slot(flow), self.slot(f"v:{flow.priority}")
        with self.mem.lock:
            c = float(self._acc[s, 0])
            self._acc[v, 1] = max(float(self._acc[v, 1]), c)
            self._acc[s, 0] = c + amount

    def set_waiting(self, flow: Flow, n: int) -> None:
        self._waiting[self.me, self.flow_slot(flow)] = n

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
