"""The OpenAI request bodies a simulated instance accepts, and vLLM's answers to them (pure: no I/O).

::

    body (JSON) ──▶ parse_completion / parse_chat ──▶ CompletionArgs / ChatArgs   or ApiError (4xx)
    engine outputs ──▶ completion_body / chat_body / *_chunk / usage_chunk ──▶ JSON bytes (SSE: "data: ..")

Checks follow vLLM's request models where a router or a client can tell: types of the fields the simulator
reads, ``max_tokens >= 1``, a non-empty string ``cache_salt``, ``stream_options`` only with ``stream``,
no request-supplied chat template (vLLM refuses one without ``--trust-request-chat-template``).  Fields it
does not read are ignored, as vLLM ignores unknown fields.  Features whose output the simulator cannot
produce (``n > 1``, ``echo``, ``logprobs``, several prompts at once) get a clear 400 instead of a silently
wrong answer.  Errors have vLLM's shape: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..errors import SimError

_encode = msgspec.json.Encoder().encode


# ---------------------------------------------------------------------------------------------- errors
class ApiError(SimError):
    """An HTTP error answer.  ``status`` and ``err_type`` as vLLM sets them."""

    status = 500
    err_type = "InternalServerError"
    reason = "api"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> bytes:
        return _encode(
            {
                "error": {
                    "message": self.message,
                    "type": self.err_type,
                    "param": self.param,
                    "code": self.status,
                }
            }
        )


class BadRequest(ApiError):
    status = 400
    err_type = "BadRequestError"
    reason = "bad_request"


class ModelNotFound(ApiError):
    status = 404
    err_type = "NotFoundError"
    reason = "model_not_found"


class EngineUnavailable(ApiError):
    status = 503
    err_type = "ServiceUnavailableError"
    reason = "unavailable"


# ---------------------------------------------------------------------------------------------- requests
class SamplingArgs(msgspec.Struct, kw_only=True):
    """What both routes read besides the prompt."""

    model: str | None = None
    max_tokens: int | None = None
    """None: up to the context (vLLM's default)."""
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    cache_salt: str | None = None
    ignore_eos: bool = False
    seed: int | None = None


class CompletionArgs(SamplingArgs, kw_only=True):
    prompt: str | list[int]


class ChatArgs(SamplingArgs, kw_only=True):
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _opt(body: dict[str, Any], key: str, kind: str) -> Any:
    v = body.get(key)
    if v is None:
        return None
    ok = {
        "bool": isinstance(v, bool),
        "int": _is_int(v),
        "number": _is_number(v),
        "str": isinstance(v, str),
        "dict": isinstance(v, dict),
        "list": isinstance(v, list),
    }[kind]
    if not ok:
        article = "an" if kind[0] in "aeiou" else "a"
        raise BadRequest(f"'{key}' must be {article} {kind}", param=key)
    return v


def _common(body: dict[str, Any], max_tokens_keys: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {"model": _opt(body, "model", "str")}
    for key in max_tokens_keys:  # chat: max_completion_tokens wins over the deprecated max_tokens
        v = _opt(body, key, "int")
        if v is not None:
            if v < 1:
                raise BadRequest(f"max_tokens must be at least 1, got {v}.", param=key)
            out["max_tokens"] = v
            break
    stream = bool(_opt(body, "stream", "bool"))
    out["stream"] = stream
    opts = _opt(body, "stream_options", "dict")
    if opts is not None:
        if not stream:
            raise BadRequest("Stream options can only be defined when `stream=True`.", param="stream_options")
        inc, cont = opts.get("include_usage", True), opts.get("continuous_usage_stats", False)
        if not isinstance(inc, (bool, type(None))) or not isinstance(cont, (bool, type(None))):
            raise BadRequest("stream_options fields must be booleans", param="stream_options")
        out["include_usage"] = bool(inc)
        out["continuous_usage"] = bool(cont)
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise BadRequest("Parameter 'cache_salt' must be a non-empty string if provided.", param="cache_salt")
    out["cache_salt"] = salt
    out["ignore_eos"] = bool(_opt(body, "ignore_eos", "bool"))
    out["seed"] = _opt(body, "seed", "int")
    n = _opt(body, "n", "int")
    if n is not None and n != 1:
        raise BadRequest("the simulated vLLM instance supports only n=1", param="n")
    t = _opt(body, "temperature", "number")
    if t is not None and t < 0:
        raise BadRequest(f"temperature must be non-negative, got {t}.", param="temperature")
    p = _opt(body, "top_p", "number")
    if p is not None and not 0 < p <= 1:
        raise BadRequest(f"top_p must be in (0, 1], got {p}.", param="top_p")
    return out


def _token_ids(v: object) -> bool:
    return isinstance(v, list) and bool(v) and all(_is_int(t) and t >= 0 for t in v)


def parse_completion(body: object) -> CompletionArgs:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if "prompt" not in body or body["prompt"] is None:
        raise BadRequest("'prompt' is required", param="prompt")
    p = body["prompt"]
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise BadRequest("the simulated vLLM instance takes one prompt per request", param="prompt")
        p = p[0]
    if not (isinstance(p, str) or _token_ids(p)):
        raise BadRequest("'prompt' must be a string or a list of token ids", param="prompt")
    if body.get("echo"):
        raise BadRequest("the simulated vLLM instance does not support echo", param="echo")
    if body.get("logprobs") is not None:
        raise BadRequest("the simulated vLLM instance does not support logprobs", param="logprobs")
    return CompletionArgs(prompt=p, **_common(body, ("max_tokens",)))


def parse_chat(body: object, *, sampling: bool = True) -> ChatArgs:
    """A chat body; ``sampling=False`` reads only what renders the prompt (``/tokenize``)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
        raise BadRequest("'messages' must be a non-empty list of objects", param="messages")
    kwargs = _opt(body, "chat_template_kwargs", "dict")
    if body.get("chat_template") is not None or "chat_template" in (kwargs or {}):
        raise BadRequest(
            "Chat template is passed with request, but --trust-request-chat-template is not set. "
            "Refused request with untrusted chat template.",
            param="chat_template",
        )
    tools = _opt(body, "tools", "list")
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise BadRequest("'tools' must be a list of objects", param="tools")
    agp = _opt(body, "add_generation_prompt", "bool")
    cfm = _opt(body, "continue_final_message", "bool")
    common: dict[str, Any] = {}
    if sampling:
        if body.get("logprobs") or body.get("top_logprobs") is not None:
            raise BadRequest("the simulated vLLM instance does not support logprobs", param="logprobs")
        common = _common(body, ("max_completion_tokens", "max_tokens"))
    return ChatArgs(
        messages=msgs,
        tools=tools,
        chat_template_kwargs=kwargs,
        add_generation_prompt=True if agp is None else agp,
        continue_final_message=bool(cfm),
        **common,
    )


def too_long(max_model_len: int, n_prompt: int, max_tokens: int | None) -> BadRequest | None:
    """vLLM's context-length refusal (0.25+ wording), or None when the request fits."""
    if max_tokens is None:
        if n_prompt < max_model_len:
            return None
        return BadRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{n_prompt} input tokens. Please reduce the length of the input messages.",
            param="input_tokens",
        )
    if n_prompt + max_tokens <= max_model_len:
        return None
    return BadRequest(
        f"This model's maximum context length is {max_model_len} tokens. However, you requested {max_tokens} "
        f"output tokens and your prompt contains {n_prompt} input tokens, for a total of "
        f"{n_prompt + max_tokens} tokens. Please reduce the length of the input prompt or the number of "
        "requested output tokens.",
        param="input_tokens",
    )


# ---------------------------------------------------------------------------------------------- answers
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_body(
    rid: str, created: int, model: str, text: str, finish: str | None, use: dict[str, Any]
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
            "kv_transfer_params": None,
        }
    )


def chat_body(
    rid: str, created: int, model: str, text: str, finish: str | None, use: dict[str, Any]
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
            "kv_transfer_params": None,
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
