"""vLLM's answers to completion and chat requests, whole and as SSE chunks (what the simulated vLLM
writes; field for field what vLLM 0.33 writes, so clients and the gateway parse them as they would vLLM's)."""

from __future__ import annotations

from typing import Any

import msgspec

_encode = msgspec.json.Encoder().encode


def completion_body(
    rid: str,
    created: int,
    model: str,
    text: str,
    finish: str | None,
    use: dict[str, Any],
    kv_transfer_params: dict[str, Any] | None = None,
) -> bytes:
    choice = {
        "index": 0,
        "text": text,
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": None,
        "prompt_logprobs": None,
    }
    return _encode(
        {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": use,
            "system_fingerprint": None,
            "kv_transfer_params": kv_transfer_params,
        }
    )


def chat_body(
    rid: str,
    created: int,
    model: str,
    text: str,
    finish: str | None,
    use: dict[str, Any],
    kv_transfer_params: dict[str, Any] | None = None,
) -> bytes:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": text,
        "reasoning_content": None,
        "tool_calls": [],
    }
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish, "stop_reason": None}
    return _encode(
        {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": use,
            "prompt_logprobs": None,
            "kv_transfer_params": kv_transfer_params,
        }
    )


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def completion_chunk(
    rid: str, created: int, model: str, text: str, finish: str | None, use: dict[str, Any] | None = None
) -> bytes:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
    obj: dict[str, Any] = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if use is not None:
        obj["usage"] = use
    return sse(obj)


def chat_chunk(
    rid: str,
    created: int,
    model: str,
    delta: dict[str, Any],
    finish: str | None,
    use: dict[str, Any] | None = None,
) -> bytes:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    obj: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if use is not None:
        obj["usage"] = use
    return sse(obj)


def usage_chunk(rid: str, created: int, model: str, obj_type: str, use: dict[str, Any]) -> bytes:
    """The last chunk with ``stream_options.include_usage``: no choices, the whole request's usage."""
    return sse(
        {"id": rid, "object": obj_type, "created": created, "model": model, "choices": [], "usage": use}
    )
