"""A bounded wait for capacity: requests that find every instance at its cap wait here, in order, for at
most ``timeout``; when ``size`` already wait, the next one is turned away at once (429 + Retry-After).

With several worker processes on one host, ``shared`` makes the queue the host's: ``size`` bounds the
waiters of every worker together, and a worker's longest waiter takes freed capacity only when no other
worker's waiter is older (the host serves its waiters in arrival order).  Capacity freed in another
worker cannot wake this one's event loop: a worker with waiters looks again every ``poll_s``."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol, TypeVar

T = TypeVar("T")


class QueueFull(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class SharedQueue(Protocol):
    """The host's queue rows (``kvrouter.host.QueueBoard``)."""

    def waiting_total(self) -> int: ...

    def set_waiting(self, n: int, head_ticket: int) -> None: ...

    def first(self, ticket: int) -> bool:
        """No other worker's waiter is older than ``ticket``."""


class _Waiter:
    __slots__ = ("fut", "ticket")

    def __init__(self, fut: asyncio.Future[None], ticket: int) -> None:
        self.fut = fut
        self.ticket = ticket
        """``time.monotonic_ns()`` when it began to wait: its place in the host's order."""


class CapacityGate:
    def __init__(
        self,
        size: int,
        timeout_s: float,
        *,
        shared: SharedQueue | None = None,
        poll_s: float = 0.002,
        on_depth: Callable[[int], None] | None = None,
    ) -> None:
        self.on_depth = on_depth
        """Told the number waiting whenever a request begins or ends waiting (a gauge)."""
        self.size = size
        self.timeout_s = timeout_s
        self.shared = shared
        self.poll_s = poll_s
        self._waiters: deque[_Waiter] = deque()

    @property
    def waiting(self) -> int:
        """Requests waiting (in every worker of the host when the queue is shared)."""
        return self.shared.waiting_total() if self.shared is not None else len(self._waiters)

    def _publish(self) -> None:
        if self.shared is not None:
            self.shared.set_waiting(len(self._waiters), self._waiters[0].ticket if self._waiters else 0)
        if self.on_depth is not None:
            self.on_depth(self.waiting)

    async def acquire(self, attempt: Callable[[], T | None]) -> T:
        """``attempt()`` until it returns a value; in between, wait for a release (FIFO)."""
        got = attempt()
        if got is not None:
            return got
        if self.waiting >= self.size:
            raise QueueFull("queue_full")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        w = _Waiter(loop.create_future(), time.monotonic_ns())
        self._waiters.append(w)
        self._publish()
        try:
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise QueueFull("queue_timeout")
                wait = remaining if self.shared is None else min(remaining, self.poll_s)
                try:
                    await asyncio.wait_for(asyncio.shield(w.fut), wait)
                except TimeoutError:
                    if self.shared is None or loop.time() >= deadline:
                        raise QueueFull("queue_timeout") from None
                # Shared: only this worker's longest waiter may take capacity, and only if no other
                # worker's waiter is older.
                if self.shared is None or (self._waiters[0] is w and self.shared.first(w.ticket)):
                    got = attempt()
                    if got is not None:
                        return got
                if w.fut.done():
                    w.fut = loop.create_future()  # keep our place
        finally:
            self._waiters.remove(w)
            if not w.fut.done():
                w.fut.cancel()
            self._publish()

    def release(self) -> None:
        """Capacity was freed: wake the longest waiter not already woken."""
        for w in self._waiters:
            if not w.fut.done():
                w.fut.set_result(None)
                return
