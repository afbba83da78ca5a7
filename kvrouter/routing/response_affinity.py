"""Which instance holds each stored Responses API answer: pure state the request path owns.

vLLM keeps a stored response (and the conversation it continues) in the memory of the one process that
produced it.  A request with ``previous_response_id``, and ``GET`` / ``cancel`` of a stored id, can only
succeed there, whatever the cache says, so the gateway remembers the producer of every response id it
sees pass::

    answer passing through ──response id──▶ record(id, instance)   ──outbox──▶ peers (replicas, Redis)
    peers' news ──────────────────────────▶ learned(id, instance, ttl_left)
    previous_response_id / GET / cancel ──▶ lookup(id) ──▶ the instance (or: not known here)

Bounded (``responses.max_entries``) and expiring (``responses.affinity_ttl_s``); entries outlive the
instance they name, so a follow-up to a response whose instance left the fleet is answered with that
reason rather than a bare "not found".  Pure: the clock comes in.
"""

from __future__ import annotations

import msgspec

from .expiring import ExpiringMap


class Holder(msgspec.Struct, frozen=True):
    """Where a response id lives."""

    instance: str
    tokens: int = 0
    """Prompt tokens of the request that produced it (the next turn's history is at least this long)."""


class SharedHolder(msgspec.Struct, frozen=True, array_like=True):
    """One entry as replicas exchange it."""

    response_id: str
    instance: str
    tokens: int
    ttl_left_ms: int


class ResponseAffinity:
    def __init__(self, ttl_s: float = 86_400.0, max_entries: int = 500_000) -> None:
        self.ttl_s = ttl_s
        self.map: ExpiringMap[str, Holder] = ExpiringMap(max_entries)
        self.outbox: list[tuple[str, Holder, float]] | None = None
        """Entries recorded here since the last publication (None: no replicas to tell)."""
        self.recorded = 0
        self.learned_from_peers = 0

    def record(self, response_id: str, holder: Holder, now: float) -> None:
        """``holder`` produced ``response_id`` just now (what this router saw pass)."""
        self.map.put(response_id, holder, now, self.ttl_s)
        self.recorded += 1
        if self.outbox is not None:
            self.outbox.append((response_id, holder, now))

    def learned(self, entry: SharedHolder, now: float) -> None:
        """A peer's entry, with what is left of its life (never published again)."""
        if entry.ttl_left_ms > 0 and entry.response_id not in self.map:
            self.map.put(
                entry.response_id, Holder(entry.instance, entry.tokens), now, entry.ttl_left_ms / 1000
            )
            self.learned_from_peers += 1

    def lookup(self, response_id: str, now: float) -> Holder | None:
        return self.map.get(response_id, now)

    def take_outbox(self, now: float) -> list[SharedHolder]:
        """What to publish: the entries recorded since the last call, with their time left."""
        box = self.outbox
        if not box:
            return []
        ttl = self.ttl_s
        out = [SharedHolder(rid, h.instance, h.tokens, int((t + ttl - now) * 1000)) for rid, h, t in box]
        box.clear()
        return [e for e in out if e.ttl_left_ms > 0]
