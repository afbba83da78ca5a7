"""Stored Responses conversations this router forwarded, so that a continuation's tokens can be computed.

vLLM keeps, per stored response, the chat messages it rendered for it (``msg_store``, system messages
included) and the response itself (its ``output`` items); a request naming it as ``previous_response_id``
is rendered from the current instructions, the stored messages without their system messages, the stored
output and its own input (vLLM 0.33 ``construct_input_messages``).  The router keeps the same two things
for the responses it saw answered, so a continuation is tokenized and hashed like any other request
instead of being routed blind to its instance.

What is kept is bounded twice: entries, and bytes (each entry is held as its JSON encoding, whose length
is what the bound counts); the least recently used entry goes first, and an entry larger than the whole
byte bound is not kept.  A continuation of an entry not kept here (another worker or replica answered it,
the router restarted, it was pushed out) is routed to its instance without tokens, as before.
"""

from __future__ import annotations

from collections import OrderedDict

import msgspec

from ..api.parsed import StoredConversation

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(StoredConversation).decode


class ResponseHistory:
    """Response id -> the conversation vLLM stores for it, least recently used out first."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, bytes] = OrderedDict()
        self.bytes = 0
        """The sum of the kept entries' encoded sizes (never above ``max_bytes``)."""
        self.dropped = 0
        """Entries pushed out by the bounds, or never kept (larger than the byte bound)."""

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, conversation: StoredConversation) -> None:
        if self.max_entries <= 0:
            return
        data = _encode(conversation)
        old = self._entries.pop(response_id, None)
        if old is not None:
            self.bytes -= len(old)
        if len(data) > self.max_bytes:
            self.dropped += 1
            return
        self._entries[response_id] = data
        self.bytes += len(data)
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            _, gone = self._entries.popitem(last=False)
            self.bytes -= len(gone)
            self.dropped += 1

    def get(self, response_id: str) -> StoredConversation | None:
        data = self._entries.get(response_id)
        if data is None:
            return None
        self._entries.move_to_end(response_id)
        return _decode(data)
