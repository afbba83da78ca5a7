"""The limits' queue and the held-requests bound, for the whole host: one row per worker.

::

    queue[k] = [waiting, head ticket (0: none), held, head flow's slot + 1 (0: none)]   written by worker k

A request that finds every target at its cap waits in its worker's flow queue; the host's queue is the
union of those, each worker showing its best waiter (its flow and ticket: the monotonic clock in
nanoseconds when it began to wait, one clock per host).  A worker's best waiter takes freed capacity only
when no other worker's best waiter outranks it, ranked with the host's shared flow accounts
(``HostFlows``), so the host serves waiters as one process would; ``queue_size`` bounds the sum of the
rows, and ``limits.max_requests`` the sum of the held counts.
"""

from __future__ import annotations

from ..flows import Flow
from .flows import HostFlows
from .memory import HostMemory

WAITING, HEAD, HELD, HEAD_FLOW = range(4)


class QueueBoard:
    """``pipeline.gate.SharedQueue`` over a ``HostMemory``, as worker ``me``."""

    def __init__(self, mem: HostMemory, me: int, flows: HostFlows | None = None) -> None:
        self._rows = mem.view("queue")
        self._own = self._rows[me]
        self.me = me
        self.flows = flows or HostFlows(mem, me)

    def waiting_total(self) -> int:
        return sum(self._rows[:, WAITING].tolist())

    def set_waiting(self, n: int, head: tuple[Flow, int] | None) -> None:
        if head is None:
            self._own[HEAD] = 0
            self._own[HEAD_FLOW] = 0
        else:
            self._own[HEAD] = 0  # no torn pair: readers skip a row without a ticket
            self._own[HEAD_FLOW] = self.flows.flow_slot(head[0]) + 1
            self._own[HEAD] = head[1]
        self._own[WAITING] = n

    def heads(self) -> list[tuple[Flow, int]]:
        """Every other worker's best waiter: its flow and ticket."""
        out = []
        for k, (ticket, slot) in enumerate(self._rows[:, [HEAD, HEAD_FLOW]].tolist()):
            if k == self.me or not ticket or not slot:
                continue
            f = self.flows.flow_at(slot - 1)
            if f is not None:
                out.append((f, ticket))
        return out

    def held_total(self) -> int:
        return sum(self._rows[:, HELD].tolist())

    def add_held(self, d: int) -> None:
        self._own[HELD] += d

    def clear_row(self, worker: int) -> None:
        self._rows[worker] = 0
        self.flows.clear_row(worker)
