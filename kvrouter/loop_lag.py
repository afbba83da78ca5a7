"""How far this process's event loop is behind: one timer, read by whoever must tell "the peer is slow"
from "we are slow", and "we are overloaded" from "we stalled once".

::

    every tick_s:  lag = when the timer ran - when it was due          (the loop's own delay)
                   blocked_s += lag                                    (a running total: callers diff it)
                   standing_s = the least lag of the ticks of the last window_s (two ticks at least)
                   demand = share of that window the loop's thread was running or waiting for a CPU

Timeouts: ``stalled(mark, timeout)``: the loop's own delay since ``mark = monitor.mark()`` was a large
share of the timeout (it says nothing about the peer).  Admission (``pipeline.admission``): one long
stall leaves ``standing_s`` at 0, only a loop behind on every turn raises it; ``demand`` (Linux
``/proc/thread-self/schedstat``; else the thread's CPU time) tells a loop that is the bottleneck from
one kept waiting by other processes (docs/gateway.md, "Admission").
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import deque
from collections.abc import Callable


class _RunnableClock:
    """Seconds the calling thread has been runnable (running, or waiting in a run queue)."""

    def __init__(self) -> None:
        self._fd: int | None = None
        with contextlib.suppress(OSError):
            fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
            try:
                os.pread(fd, 128, 0).split()[1]
            except (OSError, IndexError):
                os.close(fd)
            else:
                self._fd = fd

    def __call__(self) -> float:
        if self._fd is not None:
            try:
                run_ns, wait_ns = os.pread(self._fd, 128, 0).split()[:2]
                return (int(run_ns) + int(wait_ns)) / 1e9
            except (OSError, ValueError):
                self.close()
        return time.thread_time()

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


class LoopLag:
    """The event loop's own delay, measured by a periodic timer (``start`` in the loop, ``stop`` after)."""

    def __init__(
        self,
        tick_s: float = 0.01,
        window_s: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
        runnable: Callable[[], float] | None = None,
    ) -> None:
        """``runnable``: seconds the loop's thread has been runnable so far (default: schedstat, read from
        the thread that calls ``start``)."""
        if tick_s <= 0 or window_s <= 0:
            raise ValueError("tick_s and window_s must be positive")
        self.tick_s = tick_s
        self.window_s = window_s
        self.clock = clock
        self.blocked_s = 0.0
        """Total lag seen since start (seconds): ``stalled`` diffs it."""
        self.max_s = 0.0
        """The largest single lag seen since start."""
        self.standing_s = 0.0
        """The least lag among the ticks of the last ``window_s`` (two ticks at least)."""
        self.demand = 0.0
        """The share of the same window the loop's thread was runnable (0 to 1)."""
        self._runnable = runnable
        self._own_clock: _RunnableClock | None = None
        self._ticks: deque[tuple[float, float, float]] = deque()  # (when, lag, runnable seconds so far)
        self._due = 0.0
        self._handle: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Begin measuring on the running loop (idempotent)."""
        if self._handle is not None:
            return
        self._loop = asyncio.get_running_loop()
        if self._runnable is None:
            self._own_clock = _RunnableClock()  # opened here: the loop's thread
        self._due = self.clock() + self.tick_s
        self._handle = self._loop.call_at(self._loop.time() + self.tick_s, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._own_clock is not None:
            self._own_clock.close()
            self._own_clock = None
        self.standing_s = self.demand = 0.0
        self._ticks.clear()

    @property
    def running(self) -> bool:
        return self._handle is not None

    def _tick(self) -> None:
        now = self.clock()
        clock = self._runnable or self._own_clock
        self.observe(now - self._due, now, clock() if clock is not None else 0.0)
        self._due = now + self.tick_s
        assert self._loop is not None
        self._handle = self._loop.call_at(self._loop.time() + self.tick_s, self._tick)

    # ------------------------------------------------------------------ readings
    def observe(self, lag_s: float, now: float, runnable_s: float = 0.0) -> None:
        """One tick that ran ``lag_s`` late at ``now``, the loop's thread runnable for ``runnable_s`` so far
        (the timer calls this; tests may too)."""
        lag_s = max(0.0, lag_s)
        self.blocked_s += lag_s
        self.max_s = max(self.max_s, lag_s)
        ticks = self._ticks
        ticks.append((now, lag_s, runnable_s))
        while len(ticks) > 2 and ticks[0][0] < now - self.window_s:
            ticks.popleft()
        self.standing_s = min(t[1] for t in ticks)
        span = now - ticks[0][0]
        self.demand = min(1.0, max(0.0, (runnable_s - ticks[0][2]) / span)) if span > 0 else 0.0

    def mark(self) -> float:
        """A mark for ``blocked_since``: take it when an operation with a timeout begins."""
        if self._handle is None:
            return self.blocked_s
        return self.blocked_s + max(0.0, self.clock() - self._due)

    def blocked_since(self, mark: float) -> float:
        """How long the loop stood still since ``mark``: its ticks' total lag, the one overdue now
        included (a loop blocked right now has not run the tick that would report it)."""
        return max(0.0, self.mark() - mark)

    def stalled(self, mark: float, timeout_s: float, share: float = 0.5) -> bool:
        """Whether an operation begun at ``mark`` that ran out of ``timeout_s`` lost at least ``share`` of
        it to the loop standing still: then the timeout is this process's, not the peer's."""
        return self.blocked_since(mark) >= share * timeout_s
