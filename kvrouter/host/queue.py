"""The limits' queue and the held-requests bound, for the whole host: one row per worker.

::

    queue[k] = [waiting, head ticket (0: none), held, head flow's slot + 1 (0: none), head group's slot + 1,
                GROUPS x (slot + 1 of a group its flows' heads wait in; 0: none, -1: more than GROUPS)]
                                                                                  written by worker k
    peer_queue[0] = [other replicas' waiting, their best waiters kept, -, -]      written by the worker
    peer_queue[1 + i] = [group's slot + 1, priority, -, -]                        syncing with them

A request that finds every target at its cap waits in its worker's flow queue; the host's queue is the
union of those, each worker showing its best waiter (its flow and ticket: the monotonic clock in
nanoseconds when it began to wait, one clock per host).  A worker's best waiter takes freed capacity only
when no other worker's best waiter outranks it, ranked with the host's shared flow accounts
(``HostFlows``), so the host serves waiters as one process would; ``queue_size`` bounds the sum of the
rows, and ``limits.max_requests`` the sum of the held counts.  Other router replicas' waiters
(``kvrouter.replicas.flows``) count in the bound, and their best ones' priorities per group defer this
host's lower ones (``pipeline.gate``).  Group names take slots "g:<group>" in the flows' directory.
"""

from __future__ import annotations

from ..flows import Flow
from .flows import HostFlows
from .memory import QUEUE_GROUPS, HostMemory

WAITING, HEAD, HELD, HEAD_FLOW, HEAD_GROUP, GROUPS_AT = range(6)
GROUPS = QUEUE_GROUPS
"""Columns GROUPS_AT .. GROUPS_AT + GROUPS - 1: the groups a worker's heads wait in."""


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

    def set_waiting(self, n: int, head: tuple[Flow, int, str] | None) -> None:
        if head is None:
            self._own[HEAD] = 0
            self._own[HEAD_FLOW] = 0
        else:
            self._own[HEAD] = 0  # no torn pair: readers skip a row without a ticket
            self._own[HEAD_FLOW] = self.flows.flow_slot(head[0]) + 1
            self._own[HEAD_GROUP] = self.flows.slot(f"g:{head[2]}") + 1
            self._own[HEAD] = head[1]
        self._own[WAITING] = n

    def set_groups(self, groups: list[str]) -> None:
        """The groups this worker's flows' heads wait in (written before its waiting count)."""
        row = self._own
        if len(groups) > GROUPS:
            row[GROUPS_AT] = -1
            return
        slots = [self.flows.slot(f"g:{g}") + 1 for g in groups]
        if any(x <= 0 for x in slots):  # past the directory's slots: unknown
            row[GROUPS_AT] = -1
            return
        row[GROUPS_AT : GROUPS_AT + GROUPS] = slots + [0] * (GROUPS - len(slots))

    def other_groups(self) -> set[str] | None:
        """The groups other workers' waiters wait in (None: some worker's are not known)."""
        out: set[str] = set()
        for k, row in enumerate(self._rows.tolist()):
            if k == self.me or not row[WAITING]:
                continue
            slots = row[GROUPS_AT : GROUPS_AT + GROUPS]
            if slots[0] <= 0:
                return None
            for slot in slots:
                if slot <= 0:
                    break  # the rest are empty
                g = self._group(int(slot))
                if g is None:
                    return None
                out.add(g)
        return out

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

    def _group(self, slot: int) -> str | None:
        name = self.flows.mem.flows.name(slot - 1) if slot else None
        return name[2:] if name is not None and name.startswith("g:") else None

    def own_tops(self) -> list[tuple[str, int]]:
        """Every worker's best waiter, this one's included, as (group, priority): what other replicas see
        (a group past the directory's slots is left out)."""
        out = []
        for ticket, slot, gslot in self._rows[:, [HEAD, HEAD_FLOW, HEAD_GROUP]].tolist():
            f = self.flows.flow_at(slot - 1) if ticket and slot else None
            g = self._group(gslot)
            if f is not None and g is not None:
                out.append((g, f.priority))
        return out

    def peers_waiting(self) -> int:
        return int(self._peers[0, 0])

    def peer_tops(self) -> list[tuple[str, int]]:
        n = int(self._peers[0, 1])
        out = []
        for gslot, prio, _, _ in self._peers[1 : 1 + n].tolist():
            g = self._group(int(gslot))
            if g is not None:
                out.append((g, int(prio)))
        return out

    def set_peers(self, waiting: int, tops: list[tuple[str, int]]) -> None:
        """Other replicas' waiters and best ones (the worker syncing with them writes; past the rows kept,
        the lowest priorities are left out)."""
        p = self._peers
        p[0, 1] = 0  # readers see none while the rows change
        rows = sorted(tops, key=lambda t: -t[1])[: len(p) - 1]
        for i, (group, prio) in enumerate(rows):
            p[1 + i] = (self.flows.slot(f"g:{group}") + 1, prio, 0.0, 0.0)
        p[0, 0] = waiting
        p[0, 1] = len(rows)

    def held_total(self) -> int:
        return sum(self._rows[:, HELD].tolist())

    def add_held(self, d: int) -> None:
        self._own[HELD] += d

    def clear_row(self, worker: int) -> None:
        self._rows[worker] = 0
        self.flows.clear_row(worker)
