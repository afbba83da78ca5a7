"""Admission: whether the gateway takes one more request, decided before its body is read.

::

    front door, headers parsed ──▶ Admission.held() ──refused──▶ 429 + Retry-After (no body read)
                                      └─ taken: held until the request ends (answered, failed, gone)

    refused when  requests held (this worker, or the host's with several) >= limits.max_requests
                  ("gateway_full"), or this worker's event loop is always behind, by more than
                  limits.max_loop_lag_s (``LoopLag.standing_s``), and never idle (``LoopLag.demand``
                  >= MIN_DEMAND): "gateway_busy", refused with a probability that grows from 0 at the
                  bound to 1 at twice it.  No refusal for one long stall, nor for a loop kept waiting

Every front door calls ``held()`` first (the aiohttp proxy before reading the body; the endpoint picker
at the request headers), so this decision is written once.  Why the loop's delay: docs/gateway.md.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

from ..api.errors import Overloaded
from ..config import LimitsConfig
from ..loop_lag import LoopLag
from .metrics import PipelineMetrics


class HeldCount(Protocol):
    """Requests held by every worker process of the host (``kvrouter.host.QueueBoard``)."""

    def held_total(self) -> int: ...

    def add_held(self, d: int) -> None: ...


MIN_DEMAND = 0.9
"""A loop whose thread was runnable (on a CPU or queued for one) less than this share of the window had
time to spare: its delay is the machine's, and refusing would not shorten it."""


def busy_share(lag_s: float, bound_s: float) -> float:
    """The share of requests refused when the loop is ``lag_s`` behind: 0 up to ``bound_s``, then rising
    linearly to 1 at twice it (0 when ``bound_s`` is 0: off)."""
    if bound_s <= 0 or lag_s <= bound_s:
        return 0.0
    return min(1.0, (lag_s - bound_s) / bound_s)


class Admission:
    """The admission decision of one worker (its event loop's delay; the host's count of held requests)."""

    def __init__(
        self,
        limits: LimitsConfig,
        metrics: PipelineMetrics,
        *,
        lag: LoopLag | None = None,
        held_host: HeldCount | None = None,
        rng: Callable[[], float] = random.random,
    ) -> None:
        self.limits = limits
        self.metrics = metrics
        self.lag = lag
        """This worker's loop delay (None or not running: admission by count alone)."""
        self.rng = rng
        self.active = 0
        """Requests this worker holds right now (reading, routing, queued or proxied)."""
        self.held_host = held_host
        """The host's count of held requests (several workers: ``max_requests`` bounds them all)."""

    def refusal(self) -> Overloaded | None:
        """Why the next request is refused, or None: taken.  Reads two numbers and at most one random
        draw; counts the refusal by its reason.  A new error each time: an exception raised again keeps
        the frames of every earlier raise in its traceback."""
        cap = self.limits.max_requests
        if cap and (self.active if self.held_host is None else self.held_host.held_total()) >= cap:
            return self._count(Overloaded(f"the gateway holds {cap} requests already", reason="gateway_full"))
        bound = self.limits.max_loop_lag_s
        lag = self.lag
        if bound > 0 and lag is not None and lag.running and lag.demand >= MIN_DEMAND:
            share = busy_share(lag.standing_s, bound)
            if share > 0 and (share >= 1.0 or self.rng() < share):
                return self._count(Overloaded("the gateway is at its capacity", reason="gateway_busy"))
        return None

    def _count(self, err: Overloaded) -> Overloaded:
        self.metrics.rejections.labels(err.reason).inc()
        return err

    @contextmanager
    def held(self) -> Iterator[None]:
        """Hold one request for its whole life; ``Overloaded`` (raised at once) when it is refused."""
        err = self.refusal()
        if err is not None:
            raise err
        self.active += 1
        host = self.held_host
        if host is not None:
            host.add_held(1)
        try:
            yield
        finally:
            self.active -= 1
            if host is not None:
                host.add_held(-1)
