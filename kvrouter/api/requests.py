"""OpenAI request bodies: one reader, two strictnesses.

- ``parse_body`` (the gateway): reads what routing needs and checks only that; every other field passes
  through untouched (vLLM has many extensions the router does not read).  The body is kept as a JSON
  object and forwarded, re-encoded only when the gateway changes it (an injected tenant salt).
- ``parse_completion`` / ``parse_chat`` (the simulated vLLM): vLLM's own checks where a router or a client
  can tell (types of the fields the simulator reads, ``max_tokens >= 1``, a non-empty string
  ``cache_salt``, ``stream_options`` only with ``stream``, no request-supplied chat template), and a clear
  400 for features whose output the simulator cannot produce (``n > 1``, ``echo``, ``logprobs``, several
  prompts at once) rather than a silently wrong answer.

Both raise ``BadRequest`` with a reason the client can act on.  The other routes' bodies are read in
``responses``, ``messages`` (and, leniently, here: pooling and any other route).
"""

from __future__ import annotations

from typing import Any

import msgspec

from .errors import BadRequest
from .fields import decode_object, is_int, opt, salt, token_ids
from .messages import parse_messages
from .parsed import Kind, ParsedRequest, prefix_text
from .responses import parse_responses

__all__ = ["Kind", "ParsedRequest", "parse_body", "prefix_text"]


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
        raise BadRequest("'messages' must be a non-empty list of objects", param="messages")
    for m in msgs:
        if not isinstance(m.get("role"), str):
            raise BadRequest("every message needs a string 'role'", param="messages")
    return msgs


POOLING_INPUTS = ("input", "prompt", "text")
"""Where a pooling request (embeddings, pooling, classify) carries its text."""


def parse_body(raw: bytes, kind: Kind | None, affinity_header: str | None = None) -> ParsedRequest:
    """Parse and check a request body for its route (``kind`` None: chat or completions, decided from the
    body, as /invocations)."""
    if kind == "other":
        return parse_other(raw)
    body = decode_object(raw)
    if kind == "responses":
        return parse_responses(body, raw, affinity_header)
    if kind in ("messages", "count_tokens"):
        return parse_messages(body, raw, kind)
    if kind == "pooling":
        return parse_pooling(body, raw)
    return _parse_generation(body, raw, kind, affinity_header)


def parse_pooling(body: dict[str, Any], raw: bytes) -> ParsedRequest:
    """Embeddings, pooling, classification, scoring: the model, and a single text input to route on."""
    model = body.get("model")
    req = ParsedRequest("pooling", body, raw, model=model if isinstance(model, str) else None)
    for key in POOLING_INPUTS:
        v = body.get(key)
        if isinstance(v, list) and len(v) == 1:
            v = v[0]
        if isinstance(v, str) and v:
            req.prompt = v
            break
    return req


def parse_other(raw: bytes) -> ParsedRequest:
    """Any other route: its model when the body is a JSON object that names one (nothing is checked)."""
    body: dict[str, Any] = {}
    if raw[:1] == b"{":
        try:
            decoded = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            decoded = None
        if isinstance(decoded, dict):
            body = decoded
    model = body.get("model")
    return ParsedRequest("other", body, raw, model=model if isinstance(model, str) else None)


def _parse_generation(
    body: dict[str, Any], raw: bytes, kind: Kind | None, affinity_header: str | None
) -> ParsedRequest:
    if kind is None:
        kind = "chat" if "messages" in body else "completions"
    model = opt(body, "model", "str")
    stream = bool(opt(body, "stream", "bool"))
    opts = body.get("stream_options")
    include_usage = isinstance(opts, dict) and opts.get("include_usage") is True
    affinity = body.get("prompt_cache_key") or affinity_header
    if affinity is not None and not isinstance(affinity, str):
        raise BadRequest("'prompt_cache_key' must be a string", param="prompt_cache_key")
    session = body.get("session_id")
    req = ParsedRequest(
        kind, body, raw, model, stream, include_usage, cache_salt=salt(body), affinity=affinity
    )
    if isinstance(session, str) and session:
        req.session = session
    if kind == "chat":
        req.messages = _messages(body)
    else:
        p = body.get("prompt")
        if isinstance(p, str) or token_ids(p):
            req.prompt = p
        elif isinstance(p, list) and p and (isinstance(p[0], str) or token_ids(p[0])):
            req.prompt = p[0]  # a batch of prompts: route on the first
        else:
            raise BadRequest(
                "'prompt' must be a string, a list of token ids, or a list of those", param="prompt"
            )
    for field in ("max_tokens", "n"):
        v = body.get(field)
        if v is not None and (not is_int(v) or v < 0):
            raise BadRequest(f"'{field}' must be a non-negative integer", param=field)
    return req


# ---------------------------------------------------------------------------------------------- strict
class SamplingArgs(msgspec.Struct, kw_only=True):
    """What both generation routes of the simulated vLLM read besides the prompt."""

    model: str | None = None
    max_tokens: int | None = None
    """None: up to the context (vLLM's default)."""
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    cache_salt: str | None = None
    ignore_eos: bool = False
    seed: int | None = None
    kv_transfer_params: dict[str, Any] | None = None
    """Disaggregated prefill/decode (``api.kv_transfer``): a prefill leg's request, or a decode leg's."""


class CompletionArgs(SamplingArgs, kw_only=True):
    prompt: str | list[int]


class ChatArgs(SamplingArgs, kw_only=True):
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


def _sampling(body: dict[str, Any], max_tokens_keys: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {"model": opt(body, "model", "str")}
    for key in max_tokens_keys:  # chat: max_completion_tokens wins over the deprecated max_tokens
        v = opt(body, key, "int")
        if v is not None:
            if v < 1:
                raise BadRequest(f"max_tokens must be at least 1, got {v}.", param=key)
            out["max_tokens"] = v
            break
    stream = bool(opt(body, "stream", "bool"))
    out["stream"] = stream
    opts = opt(body, "stream_options", "dict")
    if opts is not None:
        if not stream:
            raise BadRequest("Stream options can only be defined when `stream=True`.", param="stream_options")
        inc, cont = opts.get("include_usage", True), opts.get("continuous_usage_stats", False)
        if not isinstance(inc, (bool, type(None))) or not isinstance(cont, (bool, type(None))):
            raise BadRequest("stream_options fields must be booleans", param="stream_options")
        out["include_usage"] = bool(inc)
        out["continuous_usage"] = bool(cont)
    out["cache_salt"] = salt(body)
    out["ignore_eos"] = bool(opt(body, "ignore_eos", "bool"))
    out["seed"] = opt(body, "seed", "int")
    out["kv_transfer_params"] = opt(body, "kv_transfer_params", "dict")
    n = opt(body, "n", "int")
    if n is not None and n != 1:
        raise BadRequest("the simulated vLLM instance supports only n=1", param="n")
    t = opt(body, "temperature", "number")
    if t is not None and t < 0:
        raise BadRequest(f"temperature must be non-negative, got {t}.", param="temperature")
    p = opt(body, "top_p", "number")
    if p is not None and not 0 < p <= 1:
        raise BadRequest(f"top_p must be in (0, 1], got {p}.", param="top_p")
    return out


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
    if not (isinstance(p, str) or token_ids(p)):
        raise BadRequest("'prompt' must be a string or a list of token ids", param="prompt")
    if body.get("echo"):
        raise BadRequest("the simulated vLLM instance does not support echo", param="echo")
    if body.get("logprobs") is not None:
        raise BadRequest("the simulated vLLM instance does not support logprobs", param="logprobs")
    return CompletionArgs(prompt=p, **_sampling(body, ("max_tokens",)))


def parse_chat(body: object, *, sampling: bool = True) -> ChatArgs:
    """A chat body; ``sampling=False`` reads only what renders the prompt (``/tokenize``)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    msgs = _messages(body)
    kwargs = opt(body, "chat_template_kwargs", "dict")
    if body.get("chat_template") is not None or "chat_template" in (kwargs or {}):
        raise BadRequest(
            "Chat template is passed with request, but --trust-request-chat-template is not set. "
            "Refused request with untrusted chat template.",
            param="chat_template",
        )
    tools = opt(body, "tools", "list")
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise BadRequest("'tools' must be a list of objects", param="tools")
    agp = opt(body, "add_generation_prompt", "bool")
    cfm = opt(body, "continue_final_message", "bool")
    common: dict[str, Any] = {}
    if sampling:
        if body.get("logprobs") or body.get("top_logprobs") is not None:
            raise BadRequest("the simulated vLLM instance does not support logprobs", param="logprobs")
        common = _sampling(body, ("max_completion_tokens", "max_tokens"))
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
