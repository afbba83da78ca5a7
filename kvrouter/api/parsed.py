"""What the gateway reads of a request, whatever its route: ``ParsedRequest``.

::

    kind          route                                   what is tokenized
    completions   /v1/completions                         ``prompt`` (text or token ids)
    chat          /v1/chat/completions                    ``messages`` with the chat template
    responses     /v1/responses                           ``chat``: its chat request (agent_inputs)
    messages      /v1/messages                            ``chat``: its chat request (anthropic_inputs)
    count_tokens  /v1/messages/count_tokens               the same
    pooling       /v1/embeddings /pooling /classify ...   ``prompt``: a single text input
    other         any other route vLLM has                nothing (routed by model and load)

The body is forwarded as the client sent it (re-encoded only when the gateway changes it: a tenant's
enforced salt).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

Kind = Literal["completions", "chat", "responses", "messages", "count_tokens", "pooling", "other"]

GENERATES = frozenset({"completions", "chat", "responses", "messages"})
"""Kinds whose answer is a generation (streamed or not, with usage)."""


def prefix_text(messages: list[dict[str, Any]] | None = None, prompt: str | list[int] | None = None) -> str:
    """The text prefix-hash routing reads: chat message contents (strings, or their parts' text) joined by
    newlines, the completion text, or its token ids joined by spaces."""
    if messages is not None:
        parts = []
        for m in messages:
            c = m.get("content")
            if isinstance(c, str):
                parts.append(c)
            elif isinstance(c, list):
                parts.extend(p.get("text", "") for p in c if isinstance(p, dict))
        return "\n".join(p for p in parts if isinstance(p, str))
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return " ".join(map(str, prompt))
    return ""


class StoredConversation(msgspec.Struct, frozen=True):
    """What vLLM keeps of a stored response for a later ``previous_response_id``: the chat messages it
    rendered (its ``msg_store`` entry) and the response's output items (as they were answered)."""

    messages: list[dict[str, Any]]
    output: list[dict[str, Any]]


class ParsedRequest(msgspec.Struct):
    """What the gateway reads of a request; ``body`` is forwarded."""

    kind: Kind
    body: dict[str, Any]
    raw: bytes
    model: str | None = None
    stream: bool = False
    include_usage: bool = False
    prompt: str | list[int] | None = None
    """Completions: the (first) prompt as text or token ids; pooling: a single text input."""
    messages: list[dict[str, Any]] | None = None
    """Chat: the request's messages; Responses and Messages: the chat messages they render to."""
    chat: dict[str, Any] | None = None
    """Responses and Messages: the chat-completions request vLLM renders for them (what is tokenized)."""
    cache_salt: str | None = None
    affinity: str | None = None
    """SageMaker X-Amzn-SageMaker-Prefix-Aware-Id or OpenAI prompt_cache_key."""
    session: str | None = None
    """The session the request belongs to (header, or the body's ``session_id``): the session policy."""
    lora_name: str | None = None
    """The LoRA adapter the request names (its ``model``), keyed into the block hashes as vLLM does."""
    base_model: str | None = None
    """For an adapter: the model it adapts (whose tokenizer renders the request)."""
    previous_response_id: str | None = None
    """Responses: the stored response this one continues (it must go where that one is stored)."""
    store: bool = True
    """Responses: the client asks the instance to store the answer (vLLM's default)."""
    history: StoredConversation | None = None
    """Responses: what the instance holds for ``previous_response_id``, when this router saw it answered
    (``pipeline.response_history``): the continuation is then tokenized as vLLM renders it."""
    mm_items: tuple[tuple[str, int, int], ...] = ()
    """The prompt's multimodal items as vLLM keys them, ``(identifier, offset, length)``: set by the token
    source, mixed into the block hashes (``indexer.extra_keys``)."""
    untokenized: str | None = None
    """Why the token source gave no ids for a request it could have tokenized (the reason counted)."""
    media_paths: tuple[str, ...] = ()
    """How each media item of the prompt was learnt (``tokenizer_cache.mm.items.ItemPath``)."""
    modified: bool = False
    reused_tokens: int | None = None
    """Leading tokens the tokenizer cache reused when the router tokenized it (None: not tokenized by
    the tokenizer cache): what a trace shows as the tokenize step's cache hit."""

    def prefix_text(self) -> str:
        return prefix_text(self.messages, self.prompt)

    def set_salt(self, salt: str) -> None:
        """Enforce ``salt`` as the request's ``cache_salt`` (the forwarded body carries it)."""
        self.body["cache_salt"] = self.cache_salt = salt
        if self.chat is not None:
            self.chat["cache_salt"] = salt
        self.modified = True

    def encoded_body(self) -> bytes:
        return msgspec.json.encode(self.body) if self.modified else self.raw

    @property
    def generates(self) -> bool:
        return self.kind in GENERATES
