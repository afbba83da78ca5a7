"""The queue's board for one process whose queue is shared with other router replicas only (no worker
processes beside it): what ``kvrouter.host.QueueBoard`` is for the workers of a host, kept in this
process.  Pure: the replicas' sync (``kvrouter.replicas.flows``) writes the peers' part.

::

    own     waiting, best waiter (flow, ticket, group)   set by this process's ``pipeline.CapacityGate``
    peers   waiting, best waiters (group, priority)
    flows   LocalFlows: this process's accounts and rate buckets, with the peers' service counted in
"""

from __future__ import annotations

from .config import DEFAULT_MAX_FLOWS
from .rate import LocalBuckets
from .scheduler import Flow, LocalAccounts


class LocalFlows(LocalAccounts, LocalBuckets):
    """``FlowAccounts`` and ``BucketStore`` of one process (``pipeline.gate.SharedFlows``)."""

    def __init__(self, max_flows: int = DEFAULT_MAX_FLOWS) -> None:
        LocalAccounts.__init__(self, max_flows)
        LocalBuckets.__init__(self)


class ProcessBoard:
    """``pipeline.gate.SharedQueue`` of one process; ``poll_s``: how often its best waiter looks again
    (the peers' part changes once per round trip, and each round trip wakes the gate)."""

    poll_s = 0.05

    def __init__(self, max_flows: int = DEFAULT_MAX_FLOWS) -> None:
        self.flows = LocalFlows(max_flows)
        self._waiting = 0
        self._head: tuple[Flow, int, str] | None = None
        self._peers_waiting = 0
        self._peer_tops: list[tuple[str, int]] = []

    def waiting_total(self) -> int:
        return self._waiting

    def peers_waiting(self) -> int:
        return self._peers_waiting

    def set_waiting(self, n: int, head: tuple[Flow, int, str] | None) -> None:
        self._waiting = n
        self._head = head

    def set_groups(self, groups: list[str]) -> None:
        pass  # no other worker reads them

    def other_groups(self) -> set[str] | None:
        return set()  # no other worker

    def heads(self) -> list[tuple[Flow, int]]:
        return []  # no other worker

    def peer_tops(self) -> list[tuple[str, int]]:
        return list(self._peer_tops)

    def own_tops(self) -> list[tuple[str, int]]:
        return [] if self._head is None else [(self._head[2], self._head[0].priority)]

    def set_peers(self, waiting: int, tops: list[tuple[str, int]]) -> None:
        self._peers_waiting = waiting
        self._peer_tops = list(tops)
