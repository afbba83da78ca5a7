"""Reading OpenAI-shaped request bodies: what routing needs, and a 400 with a reason for what is wrong.

The body is kept as a JSON object and forwarded (re-encoded only when the gateway changes it: an injected
tenant salt).  Unknown fields pass through untouched: vLLM has many extensions the router does not read.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

Kind = Literal["completions", "chat"]
_decode = msgspec.json.Decoder()


class BadRequest(Exception):
    """A request the gateway refuses; ``status`` is 4xx and ``reason`` tells the client why."""

    def __init__(self, reason: str, status: int = 400) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status


class ParsedRequest(msgspec.Struct):
    kind: Kind
    body: dict[str, Any]
    raw: bytes
    model: str | None = None
    stream: bool = False
    include_usage: bool = False
    prompt: str | list[int] | None = None
    """Completions: the (first) prompt as text or token ids."""
    messages: list[dict[str, Any]] | None = None
    cache_salt: str | None = None
    affinity: str | None = None
    """SageMaker X-Amzn-SageMaker-Prefix-Aware-Id or OpenAI prompt_cache_key."""
    lora_name: str | None = None
    modified: bool = False

    def prefix_text(self) -> str:
        """The text prefix-hash routing reads: the prompt, or the chat messages' text in order."""
        if self.messages is not None:
            parts = []
            for m in self.messages:
                c = m.get("content")
                if isinstance(c, str):
                    parts.append(c)
                elif isinstance(c, list):
                    parts.extend(p.get("text", "") for p in c if isinstance(p, dict))
            return "\n".join(parts)
        if isinstance(self.prompt, str):
            return self.prompt
        if isinstance(self.prompt, list):
            return " ".join(map(str, self.prompt))
        return ""

    def encoded_body(self) -> bytes:
        return msgspec.json.encode(self.body) if self.modified else self.raw


def _token_list(v: Any) -> bool:
    return isinstance(v, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in v
    )


def parse_body(raw: bytes, kind: Kind | None, affinity_header: str | None = None) -> ParsedRequest:
    """Parse and check a completions or chat body (``kind`` None: decide from the body, as /invocations)."""
    if not raw:
        raise BadRequest("empty body")
    try:
        body = _decode.decode(raw)
    except msgspec.DecodeError as e:
        raise BadRequest(f"body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    if kind is None:
        kind = "chat" if "messages" in body else "completions"
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("model must be a string")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean")
    opts = body.get("stream_options")
    include_usage = isinstance(opts, dict) and opts.get("include_usage") is True
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise BadRequest("cache_salt must be a non-empty string")
    affinity = body.get("prompt_cache_key") or affinity_header
    if affinity is not None and not isinstance(affinity, str):
        raise BadRequest("prompt_cache_key must be a string")
    req = ParsedRequest(kind, body, raw, model, stream, include_usage, cache_salt=salt, affinity=affinity)
    if kind == "chat":
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
            raise BadRequest("messages must be a non-empty list of objects")
        for m in msgs:
            if not isinstance(m.get("role"), str):
                raise BadRequest("every message needs a string role")
        req.messages = msgs
    else:
        p = body.get("prompt")
        if isinstance(p, str) or _token_list(p):
            req.prompt = p
        elif isinstance(p, list) and p and (isinstance(p[0], str) or _token_list(p[0])):
            req.prompt = p[0]  # a batch of prompts: route on the first
        else:
            raise BadRequest("prompt must be a string, a list of token ids, or a list of those")
    for field, typ in (("max_tokens", int), ("n", int)):
        v = body.get(field)
        if v is not None and (not isinstance(v, typ) or isinstance(v, bool) or v < 0):
            raise BadRequest(f"{field} must be a non-negative integer")
    return req
