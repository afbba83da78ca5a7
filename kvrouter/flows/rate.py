"""Per-tenant rate limits: requests and tokens per minute, as token buckets.  Pure: the caller gives the
time (``time.monotonic()`` in the gateway).

A bucket holds at most a minute's allowance and refills continuously; a request takes one request and its
tokens (prompt plus expected output) from its tenant's two buckets, or neither.  A request larger than a
minute's tokens passes when the bucket is full (it could never pass otherwise) and leaves it in debt.
"""

from __future__ import annotations

from collections.abc import Callable

from .config import TenantFlow


class _Bucket:
    __slots__ = ("at", "level")

    def __init__(self, level: float, at: float) -> None:
        self.level = level
        self.at = at


def _refill(b: _Bucket, per_minute: float, now: float) -> None:
    b.level = min(per_minute, b.level + max(0.0, now - b.at) * per_minute / 60.0)
    b.at = now


def _short(b: _Bucket, per_minute: float, need: float) -> float:
    """Seconds until ``b`` holds ``need`` (capped at a full bucket); 0 when it does."""
    need = min(need, per_minute)
    return 0.0 if b.level >= need else (need - b.level) * 60.0 / per_minute


class RateLimiter:
    def __init__(self, tenant: Callable[[str], TenantFlow]) -> None:
        self.tenant = tenant
        self._requests: dict[str, _Bucket] = {}
        self._tokens: dict[str, _Bucket] = {}

    def take(self, name: str, tokens: int, now: float) -> float:
        """Take one request and ``tokens`` from ``name``'s allowance: 0.0 if taken, otherwise the seconds
        until it could be (nothing is taken)."""
        t = self.tenant(name)
        rpm, tpm = t.requests_per_minute, t.tokens_per_minute
        if not rpm and not tpm:
            return 0.0
        rb = self._requests.setdefault(name, _Bucket(rpm, now))
        tb = self._tokens.setdefault(name, _Bucket(tpm, now))
        wait = 0.0
        if rpm:
            _refill(rb, rpm, now)
            wait = max(wait, _short(rb, rpm, 1.0))
        if tpm:
            _refill(tb, tpm, now)
            wait = max(wait, _short(tb, tpm, float(tokens)))
        if wait > 0:
            return wait
        if rpm:
            rb.level -= 1.0
        if tpm:
            tb.level -= tokens
        return 0.0
