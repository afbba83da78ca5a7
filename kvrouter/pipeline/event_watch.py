"""Event sources that stay silent while their instance computes prompts: the router is deaf to them.

With prefix caching on, an engine that computes a full block of a prompt stores it and publishes a
BlockStored in the same step, before the answer's first token.  So a request whose reported cached tokens
fall at least one full block short of its prompt's full blocks *owes* the router a live batch.  A source
whose live stream brings nothing while such requests pile up is deaf: its events go somewhere else (vLLM
connecting out to an address nobody binds, a wrong host or port, a firewall), and every prediction for it
rests on speculative entries alone.  That must be loud, not a quiet slide into approximate routing::

    served(src, prompt, cached)   a finished request: owed if prompt's full blocks > cached blocks
    check(live batches per src)   a source whose count moved is heard (its debts cleared);
                                  one owed >= after_requests requests, the oldest >= grace_s ago, is deaf

Pure: the gateway feeds it and turns its verdicts into a log line, a metric and ``/health``.  A prefix-cache
hit publishes nothing, so only requests that computed a block count: a fully cached workload never alarms.
"""

from __future__ import annotations

from collections import deque

import msgspec

from indexer.types import SourceKey


class DeafSource(msgspec.Struct):
    source: str
    owed_requests: int
    since_s: float
    """Seconds since the oldest request it owes a batch for finished."""


class EventWatch:
    def __init__(self, block_size: int, *, after_requests: int = 3, grace_s: float = 5.0) -> None:
        self.block_size = block_size
        self.after_requests = after_requests
        """Owed requests before a silent source is called deaf (one lost batch is not an alarm)."""
        self.grace_s = grace_s
        """How long the oldest owed request may wait for its batch (events and answers race)."""
        self._owed: dict[SourceKey, deque[float]] = {}
        self._seen: dict[SourceKey, int] = {}
        self.deaf: dict[SourceKey, DeafSource] = {}

    def served(
        self, src: SourceKey, prompt_tokens: int | None, cached_tokens: int | None, now: float
    ) -> None:
        """A request ``src`` answered.  Counted when the engine must have stored a block for it."""
        if prompt_tokens is None or cached_tokens is None:
            return
        # vLLM never serves the last prompt token from cache; a prompt's full blocks are stored when computed
        full = prompt_tokens // self.block_size
        if full > cached_tokens // self.block_size:
            q = self._owed.setdefault(src, deque(maxlen=max(1, self.after_requests)))
            q.append(now)

    def check(
        self, live_batches: dict[SourceKey, int], now: float
    ) -> tuple[list[SourceKey], list[SourceKey]]:
        """(newly deaf, heard again) given each source's live batch count (sources without an event socket
        are left out by the caller)."""
        newly, heard = [], []
        for src, n in live_batches.items():
            if n != self._seen.get(src, 0):
                self._seen[src] = n
                self._owed.pop(src, None)
                if self.deaf.pop(src, None) is not None:
                    heard.append(src)
                continue
            q = self._owed.get(src)
            if q is None or len(q) < self.after_requests or now - q[0] < self.grace_s:
                continue
            if src not in self.deaf:
                newly.append(src)
            self.deaf[src] = DeafSource(src.label(), len(q), round(now - q[0], 1))
        for src in [s for s in self.deaf if s not in live_batches]:
            del self.deaf[src]
        return newly, heard

    def forget(self, src: SourceKey) -> None:
        self._owed.pop(src, None)
        self._seen.pop(src, None)
        self.deaf.pop(src, None)
