"""The multimodal encoder's work per step, as vLLM 0.33's scheduler decides it.

vLLM (``v1/core/sched/scheduler.py``, ``_try_schedule_encoder_inputs``) runs an item's encoder when the
step's token window ``[num_computed_tokens, num_computed_tokens + num_new_tokens)`` overlaps the item's
placeholder range and the item's output is not in the encoder cache (``v1/core/encoder_cache_manager.py``:
shared between requests by identifier, sized in embeddings, entries no request uses evicted oldest
first).  A prefix-cache hit that covers an item's whole range puts the window past it: the item is never
encoded.  A miss pays the encoder on top of the prefill of its placeholder tokens.

Modelled: every placeholder token is an embedding (Qwen-VL; Gemma 3's newlines are few); the cache keeps
identifiers oldest-first up to ``capacity`` embeddings and may evict one a running request still reads
(vLLM would not, so a request never encodes its item twice there, nor here: ``EncoderWindow`` keeps each
request's progress).  The encoder budget per step is not limited (vLLM's defaults fit one item per step
at least; a step with several large items runs them all).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

ItemRange = tuple[str, int, int]
"""``(identifier, offset, length)`` of one item in a prompt, in offset order."""


class EncoderCache:
    """Encoder outputs kept by identifier, oldest evicted first, at most ``capacity`` embeddings."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("encoder cache capacity must be >= 0")
        self.capacity = capacity
        self._items: OrderedDict[str, int] = OrderedDict()
        self._used = 0
        self.hits = 0
        self.misses = 0

    def lookup(self, identifier: str, length: int) -> bool:
        """True when the item's output is cached (it is then the newest); else it is added (encoded)."""
        if identifier in self._items:
            self._items.move_to_end(identifier)
            self.hits += 1
            return True
        self.misses += 1
        if length <= self.capacity:
            self._items[identifier] = length
            self._used += length
            while self._used > self.capacity:
                _, n = self._items.popitem(last=False)
                self._used -= n
        return False


class EncoderWindow:
    """One request's items and how far its encoder inputs have been scheduled."""

    __slots__ = ("items", "next")

    def __init__(self, items: Sequence[ItemRange]) -> None:
        self.items = tuple(sorted(items, key=lambda i: i[1]))
        self.next = 0
        """Items before this index were encoded, found cached, or lay inside the computed prefix."""

    def reset(self) -> None:
        """Preempted: its computed tokens are gone, its items are scheduled again from the start."""
        self.next = 0

    def encode(self, start: int, end: int, cache: EncoderCache) -> int:
        """Embeddings the encoder computes for a step that computes tokens ``[start, end)``."""
        tokens = 0
        items = self.items
        i = self.next
        while i < len(items):
            ident, offset, length = items[i]
            if offset >= end:
                break  # not reached yet
            if offset + length > start and not cache.lookup(ident, length):
                tokens += length
            i += 1
        self.next = i
        return tokens
