"""Per-tenant rate limits: requests and tokens per minute, as token buckets.  Pure: the caller gives the
time (``time.monotonic()`` in the gateway), and the buckets live in a ``BucketStore``: this process's
(``LocalBuckets``) or the host's, shared by its worker processes (``kvrouter.host.HostRates``).

A bucket holds at most a minute's allowance and refills continuously; a request takes one request and its
tokens (prompt plus expected output) from its tenant's two buckets, or neither.  A request larger than a
minute's tokens passes when the bucket is full (it could never pass otherwise) and leaves it in debt.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from .config import TenantFlow

Buckets = list[float]
"""``[requests level, requests refilled at, tokens level, tokens refilled at]``; at < 0: never used."""


class BucketStore(Protocol):
    def update(self, tenant: str, fn: Callable[[Buckets], float]) -> float:
        """``fn`` reads and changes ``tenant``'s buckets in place, as one step (under the host's lock where
        several processes share them); returns what ``fn`` returns."""

    def count(self, tenant: str, requests: float, tokens: float) -> None:
        """``tenant`` was let through with ``requests`` and ``tokens`` (its allowance taken)."""

    def counted(self) -> dict[str, tuple[float, float]]:
        """Per tenant, the requests and tokens let through here since start: what other router replicas
        take from their buckets (``kvrouter.replicas.flows``)."""


class LocalBuckets:
    def __init__(self) -> None:
        self._b: dict[str, Buckets] = {}
        self._taken: dict[str, tuple[float, float]] = {}

    def update(self, tenant: str, fn: Callable[[Buckets], float]) -> float:
        return fn(self._b.setdefault(tenant, [0.0, -1.0, 0.0, -1.0]))

    def count(self, tenant: str, requests: float, tokens: float) -> None:
        r, t = self._taken.get(tenant, (0.0, 0.0))
        self._taken[tenant] = (r + requests, t + tokens)

    def counted(self) -> dict[str, tuple[float, float]]:
        return dict(self._taken)


def _refill(b: Buckets, i: int, per_minute: float, now: float) -> None:
    level, at = b[i], b[i + 1]
    b[i] = per_minute if at < 0 else min(per_minute, level + max(0.0, now - at) * per_minute / 60.0)
    b[i + 1] = now


def _short(level: float, per_minute: float, need: float) -> float:
    """Seconds until a bucket at ``level`` holds ``need`` (capped at a full bucket); 0 when it does."""
    need = min(need, per_minute)
    return 0.0 if level >= need else (need - level) * 60.0 / per_minute


class RateLimiter:
    def __init__(self, tenant: Callable[[str], TenantFlow], store: BucketStore | None = None) -> None:
        self.tenant = tenant
        self.store: BucketStore = store or LocalBuckets()

    def take(self, name: str, tokens: int, now: float) -> float:
        """Take one request and ``tokens`` from ``name``'s allowance: 0.0 if taken, otherwise the seconds
        until it could be (nothing is taken)."""
        t = self.tenant(name)
        rpm, tpm = t.requests_per_minute, t.tokens_per_minute
        if not rpm and not tpm:
            return 0.0

        def step(b: Buckets) -> float:
            wait = 0.0
            if rpm:
                _refill(b, 0, rpm, now)
                wait = max(wait, _short(b[0], rpm, 1.0))
            if tpm:
                _refill(b, 2, tpm, now)
                wait = max(wait, _short(b[2], tpm, float(tokens)))
            if wait > 0:
                return wait
            if rpm:
                b[0] -= 1.0
            if tpm:
                b[2] -= tokens
            return 0.0

        wait = self.store.update(name, step)
        if wait == 0.0:
            self.store.count(name, 1.0, float(tokens))
        return wait

    def debit(self, name: str, requests: float, tokens: float, now: float) -> None:
        """Take what ``name`` was let through elsewhere (another router replica) from its buckets, which
        may go into debt: its next requests here wait for the refill."""
        t = self.tenant(name)
        rpm, tpm = t.requests_per_minute, t.tokens_per_minute
        if not (rpm and requests) and not (tpm and tokens):
            return

        def step(b: Buckets) -> float:
            if rpm:
                _refill(b, 0, rpm, now)
                b[0] -= requests
            if tpm:
                _refill(b, 2, tpm, now)
                b[2] -= tokens
            return 0.0

        self.store.update(name, step)
