"""A bounded wait for capacity: requests that find every instance at its cap wait here, in order, for at
most ``timeout``; when ``size`` already wait, the next one is turned away at once (429 + Retry-After)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class QueueFull(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class CapacityGate:
    def __init__(self, size: int, timeout_s: float) -> None:
        self.size = size
        self.timeout_s = timeout_s
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self, attempt: Callable[[], T | None]) -> T:
        """``attempt()`` until it returns a value; in between, wait for a release (FIFO)."""
        got = attempt()
        if got is not None:
            return got
        if len(self._waiters) >= self.size:
            raise QueueFull("queue_full")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        fut: asyncio.Future[None] = loop.create_future()
        self._waiters.append(fut)
        try:
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise QueueFull("queue_timeout")
                try:
                    await asyncio.wait_for(asyncio.shield(fut), remaining)
                except TimeoutError:
                    raise QueueFull("queue_timeout") from None
                got = attempt()
                if got is not None:
                    return got
                fut = loop.create_future()
                self._waiters.appendleft(fut)  # keep our place at the head
        finally:
            if fut in self._waiters:
                self._waiters.remove(fut)
            if not fut.done():
                fut.cancel()

    def release(self) -> None:
        """Capacity was freed: wake the longest waiter."""
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
