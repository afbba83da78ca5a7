"""When a target takes no more requests: the fleet's own signals, and the capacity kept for high priority.

A target is full for a request when any limit it has reached says so::

    in flight (the router's, other replicas', or vLLM's running + waiting)  >= max_in_flight x share
    prompt tokens still to prefill there                                    >= max_prefill_tokens x share
    vLLM's KV-cache usage (its last scrape)                                 >= max_kv_usage x share

``share`` is 1 for requests that may fill the reserve, ``1 - reserve`` for the others: the last part of every
limit is kept for requests of priority ``reserved_priority`` and above whose flow has no other request
waiting (``reserved``).  A target with nothing left to prefill always takes a request, however long its
prompt (a limit below one prompt must not make it unservable).  Why these signals and the reserve:
docs/flows.md, "When an instance is full".  Pure: no clock, no I/O."""

from __future__ import annotations

import math

import msgspec

from indexer.errors import ConfigError

from .policies import Candidate


class Saturation(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The fleet file's ``routing.saturation`` section (``max_in_flight`` stays ``limits.max_in_flight``)."""

    max_prefill_tokens: int = 0
    """Prompt tokens still to prefill at a target (dispatched there minus what it is predicted to cache,
    plus other replicas' reports) at which it takes no more (0: no limit)."""
    max_kv_usage: float = 0.0
    """vLLM's ``kv_cache_usage_perc`` (0-1, its last scrape) at which a target takes no more (0: no
    limit).  Only targets whose metrics are scraped report it."""
    reserve: float = 0.0
    """Share (0-1) of every limit kept for requests of priority ``reserved_priority`` and above."""
    reserved_priority: int = 1

    def validate(self) -> None:
        if self.max_prefill_tokens < 0 or not 0.0 <= self.max_kv_usage <= 1.0:
            raise ConfigError("routing.saturation: max_prefill_tokens must be >= 0, max_kv_usage in [0, 1]")
        if not 0.0 <= self.reserve < 1.0:
            raise ConfigError("routing.saturation.reserve must be in [0, 1)")

    def reserved(self, priority: int, flow_waiting: int) -> bool:
        """Whether a request may fill the reserve: its priority is ``reserved_priority`` or above and at
        most one request of its flow waits (itself).  The same rule in every front door and the
        evaluator."""
        return priority >= self.reserved_priority and flow_waiting <= 1

    def share(self, reserved: bool) -> float:
        return 1.0 if reserved else 1.0 - self.reserve

    def cap(self, max_in_flight: int, reserved: bool) -> int:
        """The in-flight cap a request sees (0: none); at least 1 where there is a cap."""
        if not max_in_flight:
            return 0
        return max(1, math.floor(max_in_flight * self.share(reserved) + 1e-9))

    def full(self, c: Candidate, max_in_flight: int, reserved: bool) -> str | None:
        """Which limit ``c`` has reached for a request (``reserved``: one that may fill the reserve), or
        None: it takes one."""
        cap = self.cap(max_in_flight, reserved)
        if cap and c.in_flight >= cap:
            return "in_flight"
        share = self.share(reserved)
        pending = c.pending_prefill_tokens
        if self.max_prefill_tokens and pending > 0 and pending >= self.max_prefill_tokens * share:
            return "prefill_tokens"
        if self.max_kv_usage and c.kv_usage >= self.max_kv_usage * share:
            return "kv_usage"
        return None
