"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) as vLLM 0.33 serves it: the
gateway's reading, the simulated vLLM's checks, vLLM's answers and its Anthropic-shaped errors.

::

    error       {"type": "error", "error": {"type": "invalid_request_error" | "not_found_error" |
                 "rate_limit_error" | "overloaded_error" | "api_error" ..., "message": "..."}}
    answer      {"id", "type": "message", "role": "assistant", "content": [{"type": "text", "text"}],
                 "model", "stop_reason": "end_turn" | "max_tokens", "stop_sequence": null, "usage"}
    usage       input_tokens = prompt tokens - cache_read_input_tokens (vLLM's prompt-token details)
    stream      message_start, content_block_start, content_block_delta (text_delta) ...,
                content_block_stop, message_delta (stop_reason, usage), message_stop; no [DONE]
    count       {"input_tokens": N, "context_management": {"original_input_tokens": N}}
"""

from __future__ import annotations

from typing import Any

import msgspec

from .errors import ApiError, BadRequest
from .fields import opt
from .parsed import Kind, ParsedRequest

_encode = msgspec.json.Encoder().encode

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_type(status: int) -> str:
    """Anthropic's ``error.type`` for an HTTP status, as vLLM translates it."""
    return _ERROR_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")


def anthropic_error_body(status: int, message: str) -> bytes:
    return _encode({"type": "error", "error": {"type": error_type(status), "message": message}})


def sse_error(err: ApiError) -> bytes:
    """An error inside a Messages stream that already began."""
    data = _encode({"type": "error", "error": {"type": error_type(err.status), "message": err.message}})
    return b"event: error\ndata: " + data + b"\n\n"


def _text_of(content: object) -> list[str]:
    if isinstance(content, str):
        return [content]
    out = []
    for b in content if isinstance(content, list) else []:
        if isinstance(b, dict):
            for key in ("text", "thinking", "content"):
                if isinstance(b.get(key), str):
                    out.append(b[key])
    return out


def anthropic_text(body: dict[str, Any]) -> str:
    """The text prefix-hash routing reads of a Messages body: system, then every message's text."""
    parts = _text_of(body.get("system"))
    for m in body.get("messages") or []:
        if isinstance(m, dict):
            parts.extend(_text_of(m.get("content")))
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------- gateway
def parse_messages(body: dict[str, Any], raw: bytes, kind: Kind) -> ParsedRequest:
    """What the gateway reads of a Messages body; its chat request is built with the model's template
    facts when it is tokenized (``pipeline.fleet_tokens``)."""
    req = ParsedRequest(
        kind, body, raw, model=opt(body, "model", "str"), stream=bool(opt(body, "stream", "bool"))
    )
    if kind == "messages":
        req.include_usage = True  # the final message_delta always carries usage
    req.prompt = anthropic_text(body)
    salt = body.get("cache_salt")
    req.cache_salt = salt if isinstance(salt, str) and salt else None
    return req


# ---------------------------------------------------------------------------------------------- strict
class MessagesArgs(msgspec.Struct, kw_only=True):
    body: dict[str, Any]
    model: str
    max_tokens: int | None = None
    stream: bool = False
    cache_salt: str | None = None


def parse_messages_args(body: object, *, count: bool = False) -> MessagesArgs:
    """vLLM's checks of a Messages (or count_tokens) body where a client can tell."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("Model is required", param="model")
    if not isinstance(body.get("messages"), list):
        raise BadRequest("'messages' must be a list of messages", param="messages")
    max_tokens = None
    if not count:
        max_tokens = body.get("max_tokens")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
            raise BadRequest("'max_tokens' is required and must be an integer", param="max_tokens")
        if max_tokens <= 0:
            raise BadRequest("max_tokens must be positive", param="max_tokens")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise BadRequest("'cache_salt' must be a non-empty string", param="cache_salt")
    return MessagesArgs(
        body=body,
        model=model,
        max_tokens=max_tokens,
        stream=bool(opt(body, "stream", "bool")),
        cache_salt=salt,
    )


# ---------------------------------------------------------------------------------------------- answers
def anthropic_usage(prompt: int, cached: int, output: int) -> dict[str, Any]:
    return {
        "input_tokens": max(0, prompt - cached),
        "output_tokens": output,
        "cache_read_input_tokens": cached,
    }


def stop_reason(finish: str | None) -> str | None:
    return {"length": "max_tokens", "stop": "end_turn"}.get(finish or "")


def message_body(mid: str, model: str, text: str, finish: str | None, use: dict[str, Any]) -> bytes:
    return _encode(
        {
            "id": mid,
            "type": "message",
            "role": "assistant",
            "content": [{"type": "text", "text": text}],
            "model": model,
            "stop_reason": stop_reason(finish),
            "stop_sequence": None,
            "usage": use,
        }
    )


def event(kind: str, obj: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + _encode({"type": kind, **obj}) + b"\n\n"


def message_start(mid: str, model: str, use: dict[str, Any]) -> bytes:
    msg: dict[str, Any] = {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": model,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": use,
    }
    return event("message_start", {"message": msg})


def count_body(n: int) -> bytes:
    return _encode({"input_tokens": n, "context_management": {"original_input_tokens": n}})
