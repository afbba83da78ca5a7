"""What a simulated instance keeps of its Responses API answers, as vLLM does in its process memory.

vLLM (with ``VLLM_ENABLE_RESPONSES_API_STORE=1``) keeps every stored response and the chat messages it
was rendered from, forever; a later request with ``previous_response_id`` continues that conversation,
``GET /v1/responses/{id}`` returns the response and ``.../cancel`` cancels a background one.  The
simulator keeps at most ``capacity`` of them (the oldest go first) so a long run does not grow without
bound; a dropped id answers 404 like one never stored.  An instance that crashes loses them all.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class StoredResponse:
    __slots__ = ("messages", "response")

    def __init__(self, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        self.response = response
        """The response object as last written (its status changes while a background one runs)."""
        self.messages = messages
        """The chat messages the request rendered to (the next turn's history)."""


class ResponseStore:
    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def get(self, response_id: str) -> StoredResponse | None:
        return self._items.get(response_id)

    def put(self, response_id: str, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        self._items[response_id] = StoredResponse(response, messages)
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def clear(self) -> None:
        self._items.clear()

    def __len__(self) -> int:
        return len(self._items)
