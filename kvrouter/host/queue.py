"""The limits' queue and the held-requests bound, for the whole host: one row per worker.

::

    queue[k] = [waiting, head ticket (0: none), held, spare]      written by worker k only

A request that finds every target at its cap waits in its worker's FIFO; the host's queue is the union of
those FIFOs, ordered by ticket (the monotonic clock in nanoseconds when the request began to wait, one
clock per host).  A worker's head waiter takes freed capacity only when no other worker holds an older
head, so the host serves waiters in arrival order as one process would; ``queue_size`` bounds the sum of
the rows, and ``limits.max_requests`` the sum of the held counts.
"""

from __future__ import annotations

from .memory import HostMemory

WAITING, HEAD, HELD = range(3)


class QueueBoard:
    """``pipeline.gate.SharedQueue`` over a ``HostMemory``, as worker ``me``."""

    def __init__(self, mem: HostMemory, me: int) -> None:
        self._rows = mem.view("queue")
        self._own = self._rows[me]
        self.me = me

    def waiting_total(self) -> int:
        return sum(self._rows[:, WAITING].tolist())

    def set_waiting(self, n: int, head_ticket: int) -> None:
        self._own[HEAD] = head_ticket
        self._own[WAITING] = n

    def first(self, ticket: int) -> bool:
        """No other worker's head waiter began to wait before ``ticket``."""
        heads = self._rows[:, HEAD].tolist()
        return not any(0 < h < ticket for k, h in enumerate(heads) if k != self.me)

    def held_total(self) -> int:
        return sum(self._rows[:, HELD].tolist())

    def add_held(self, d: int) -> None:
        self._own[HELD] += d

    def clear_row(self, worker: int) -> None:
        self._rows[worker] = 0
