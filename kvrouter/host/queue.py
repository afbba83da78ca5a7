"""The limits' queue and the held-requests bound, for the whole host: one row per worker.

::

    queue[k] = [waiting, head ticket (0: none), held, head flow's slot + 1 (0: none)]   written by worker k
    peer_queue[0] = [other replicas' waiting, their heads kept, -, -]                  written by the worker
    peer_queue[1 + i] = [head flow's slot + 1, ticket, its counter, -]                 syncing with them

A request that finds every target at its cap waits in its worker's flow queue; the host's queue is the
union of those, each worker showing its best waiter (its flow and ticket: the monotonic clock in
nanoseconds when it began to wait, one clock per host).  A worker's best waiter takes freed capacity only
when no other worker's best waiter outranks it, ranked with the host's shared flow accounts
(``HostFlows``), so the host serves waiters as one process would; ``queue_size`` bounds the sum of the
rows, and ``limits.max_requests`` the sum of the held counts.  Other router replicas' waiters
(``kvrouter.replicas.flows``) count in the bound and rank as their replica ranked them (their counter).
"""

from __future__ import annotations

from ..flows import Flow
from .flows import HostFlows
from .memory import HostMemory

WAITING, HEAD, HELD, HEAD_FLOW = range(4)


class QueueBoard:
    """``pipeline.gate.SharedQueue`` over a ``HostMemory``, as worker ``me``; ``poll_s``: how often a
    worker with waiters looks again (capacity freed in another worker cannot wake it)."""

    poll_s = 0.002

    def __init__(self, mem: HostMemory, me: int, flows: HostFlows | None = None) -> None:
        self._rows = mem.view("queue")
        self._own = self._rows[me]
        self._peers = mem.view("peer_queue")
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

    def _heads(self, skip: int) -> list[tuple[Flow, int]]:
        out = []
        for k, (ticket, slot) in enumerate(self._rows[:, [HEAD, HEAD_FLOW]].tolist()):
            if k == skip or not ticket or not slot:
                continue
            f = self.flows.flow_at(slot - 1)
            if f is not None:
                out.append((f, ticket))
        return out

    def heads(self) -> list[tuple[Flow, int, float | None]]:
        """Every other worker's best waiter (flow, ticket, None: ranked with the host's accounts), then
        other replicas' (flow, ticket, their counter)."""
        out: list[tuple[Flow, int, float | None]] = [(f, t, None) for f, t in self._heads(self.me)]
        n = int(self._peers[0, 1])
        for slot, ticket, counter, _ in self._peers[1 : 1 + n].tolist():
            f = self.flows.flow_at(int(slot) - 1) if slot else None
            if f is not None:
                out.append((f, int(ticket), counter))
        return out

    def own_heads(self) -> list[tuple[Flow, int]]:
        """Every worker's best waiter, this one's included: what the host shows other replicas."""
        return self._heads(-1)

    def peers_waiting(self) -> int:
        return int(self._peers[0, 0])

    def set_peers(self, waiting: int, heads: list[tuple[Flow, int, float]]) -> None:
        """Other replicas' waiters and best ones (the worker syncing with them writes; past the rows kept,
        heads are left out)."""
        p = self._peers
        p[0, 1] = 0  # readers see no heads while the rows change
        rows = heads[: len(p) - 1]
        for i, (f, ticket, counter) in enumerate(rows):
            p[1 + i] = (self.flows.flow_slot(f) + 1, ticket, counter, 0.0)
        p[0, 0] = waiting
        p[0, 1] = len(rows)

    def held_total(self) -> int:
        return sum(self._rows[:, HELD].tolist())

    def add_held(self, d: int) -> None:
        self._own[HELD] += d

    def clear_row(self, worker: int) -> None:
        self._rows[worker] = 0
        self.flows.clear_row(worker)
