"""The Responses API (``/v1/responses``) as vLLM 0.33 serves it: the gateway's reading of a request, the
simulated vLLM's strict one, and vLLM's answers (a response object, its SSE events, its errors).

::

    POST /v1/responses            body ──▶ ParsedRequest(kind="responses", messages=<its chat messages>)
    GET  /v1/responses/{id}       the stored response (404 "Response with id '...' not found.")
    POST /v1/responses/{id}/cancel  only a background response still queued or in progress

A streamed answer is ``event: <type>\\ndata: <json>\\n\\n`` events: response.created, response.in_progress,
response.output_item.added, response.content_part.added, response.output_text.delta ...,
response.output_text.done, response.content_part.done, response.output_item.done, then
response.completed (or response.incomplete when cut by max_output_tokens), each with its sequence number.
Usage: ``input_tokens``, ``input_tokens_details.cached_tokens``, ``output_tokens``.
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

from tokenizer_cache.agent_inputs import AgentInputError, responses_messages

from .errors import ApiError, BadRequest, NotFound
from .fields import opt, salt
from .parsed import ParsedRequest

_encode = msgspec.json.Encoder().encode


# ---------------------------------------------------------------------------------------------- gateway
def parse_responses(body: dict[str, Any], raw: bytes, affinity_header: str | None) -> ParsedRequest:
    """What the gateway reads of a Responses body; its tokens are computed from the body itself
    (``CachedTokenizer.aencode_responses_request``); ``messages`` (the chat messages vLLM builds) give the
    prefix text.  A continuation (``previous_response_id``) renders with a history only its instance
    holds: it is routed to that instance without tokens."""
    affinity = body.get("prompt_cache_key") or affinity_header
    if affinity is not None and not isinstance(affinity, str):
        raise BadRequest("'prompt_cache_key' must be a string", param="prompt_cache_key")
    session = body.get("session_id")
    req = ParsedRequest(
        "responses",
        body,
        raw,
        model=opt(body, "model", "str"),
        stream=bool(opt(body, "stream", "bool")),
        cache_salt=salt(body),
        affinity=affinity,
        session=session if isinstance(session, str) and session else None,
        previous_response_id=opt(body, "previous_response_id", "str"),
        store=bool(body.get("store", True)),
    )
    try:
        req.messages = responses_messages(body.get("instructions"), body.get("input"))
    except AgentInputError:
        pass  # vLLM answers it (a 400): routed without tokens, never refused here
    return req


def completed_output(obj: object) -> list[dict[str, Any]] | None:
    """The output items of a finished response object, or of the one a stream's final event carries (None
    for anything else: a response still in progress has no final output)."""
    if not isinstance(obj, dict):
        return None
    resp = obj if obj.get("object") == "response" else obj.get("response")
    if not isinstance(resp, dict) or resp.get("object") != "response":
        return None
    out = resp.get("output")
    if resp.get("status") not in ("completed", "incomplete") or not isinstance(out, list):
        return None
    return [o for o in out if isinstance(o, dict)]


def response_id_of(obj: object) -> str | None:
    """The id of a response object, or of the response an event carries (None for anything else)."""
    if not isinstance(obj, dict):
        return None
    if obj.get("object") == "response" and isinstance(obj.get("id"), str):
        return str(obj["id"])
    inner = obj.get("response")
    if isinstance(inner, dict) and inner.get("object") == "response" and isinstance(inner.get("id"), str):
        return str(inner["id"])
    return None


class ResponseNotFound(NotFound):
    """vLLM's answer for a response id its instance does not hold."""

    err_type = "invalid_request_error"
    reason = "response_not_found"

    def __init__(self, response_id: str, message: str | None = None) -> None:
        super().__init__(message or f"Response with id '{response_id}' not found.", "response_id")


def sse_event(kind: str, obj: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + _encode(obj) + b"\n\n"


def sse_error(err: ApiError) -> bytes:
    """An error inside a Responses stream that already began (the Responses API's error event)."""
    event = {"type": "error", "code": err.reason, "message": err.message, "param": err.param}
    return sse_event("error", {**event, "sequence_number": 0})


# ---------------------------------------------------------------------------------------------- strict
class ResponsesArgs(msgspec.Struct, kw_only=True):
    """What the simulated vLLM reads of a Responses request."""

    body: dict[str, Any]
    model: str | None = None
    max_output_tokens: int | None = None
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    cache_salt: str | None = None
    seed: int | None = None
    ignore_eos: bool = False
    request_id: str = ""
    temperature: float | None = None
    top_p: float | None = None
    kv_transfer_params: dict[str, Any] | None = None
    """Disaggregated prefill/decode (``api.kv_transfer``), as on chat and completions."""


def parse_responses_args(body: object) -> ResponsesArgs:
    """vLLM's checks of a Responses body where a client can tell (400 with its reason)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if "input" not in body:
        raise BadRequest("'input' is required", param="input")
    mot = opt(body, "max_output_tokens", "int")
    if mot is not None and mot < 1:
        raise BadRequest(f"max_tokens must be at least 1, got {mot}.", param="max_output_tokens")
    prev = opt(body, "previous_response_id", "str")
    if prev is not None and body.get("previous_input_messages"):
        raise BadRequest(
            "Only one of `previous_input_messages` and `previous_response_id` can be set.",
            param="previous_response_id",
        )
    rid = opt(body, "request_id", "str")
    return ResponsesArgs(
        body=body,
        model=opt(body, "model", "str"),
        max_output_tokens=mot,
        stream=bool(opt(body, "stream", "bool")),
        store=bool(body.get("store", True)),
        background=bool(opt(body, "background", "bool")),
        previous_response_id=prev,
        cache_salt=salt(body),
        seed=opt(body, "seed", "int"),
        ignore_eos=bool(opt(body, "ignore_eos", "bool")),
        kv_transfer_params=opt(body, "kv_transfer_params", "dict"),
        request_id=rid or f"resp_{uuid.uuid4().hex}",
        temperature=opt(body, "temperature", "number"),
        top_p=opt(body, "top_p", "number"),
    )


# ---------------------------------------------------------------------------------------------- answers
def output_message(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    part: dict[str, Any] = {"annotations": [], "text": text, "type": "output_text", "logprobs": None}
    return {
        "id": item_id or f"msg_{uuid.uuid4().hex}",
        "content": [part] if text else [],
        "role": "assistant",
        "status": status,
        "type": "message",
        "phase": None,
    }


def responses_usage(prompt: int, cached: int, output: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": cached,
            "cache_write_tokens": 0,
            "input_tokens_per_turn": [],
            "cached_tokens_per_turn": [],
        },
        "output_tokens": output,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": prompt + output,
    }


def response_object(
    args: ResponsesArgs,
    model: str,
    created: int,
    status: str,
    output: list[dict[str, Any]],
    max_tokens: int,
    use: dict[str, Any] | None,
) -> dict[str, Any]:
    """A response object with every field vLLM's ``ResponsesResponse`` writes."""
    b = args.body
    tools = b.get("tools") or []
    return {
        "id": args.request_id,
        "created_at": created,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": b.get("instructions"),
        "metadata": b.get("metadata"),
        "model": model,
        "object": "response",
        "output": output,
        "parallel_tool_calls": b.get("parallel_tool_calls", True) is not False,
        "temperature": 1.0 if args.temperature is None else args.temperature,
        "tool_choice": b.get("tool_choice", "auto") if tools else "none",
        "tools": tools,
        "top_p": 1.0 if args.top_p is None else args.top_p,
        "background": args.background,
        "max_output_tokens": max_tokens,
        "max_tool_calls": b.get("max_tool_calls"),
        "previous_response_id": args.previous_response_id,
        "prompt": None,
        "prompt_cache_options": None,
        "prompt_cache_key": b.get("prompt_cache_key"),
        "prompt_cache_retention": None,
        "reasoning": b.get("reasoning"),
        "safety_identifier": b.get("safety_identifier"),
        "service_tier": b.get("service_tier", "auto"),
        "status": status,
        "text": b.get("text"),
        "top_logprobs": None,
        "truncation": b.get("truncation") or "disabled",
        "usage": use,
        "user": b.get("user"),
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "input_messages": None,
        "output_messages": None,
    }


class ResponseStream:
    """The events of one streamed text answer, numbered as vLLM numbers them."""

    def __init__(self, response: dict[str, Any]) -> None:
        self.response = response
        self.seq = 0
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.text: list[str] = []
        self.opened = False

    def _event(self, kind: str, **fields: Any) -> bytes:
        out = sse_event(kind, {"type": kind, "sequence_number": self.seq, **fields})
        self.seq += 1
        return out

    def start(self) -> bytes:
        r = self.response
        return self._event("response.created", response=r) + self._event("response.in_progress", response=r)

    def delta(self, text: str) -> bytes:
        if not text:
            return b""
        out = b""
        if not self.opened:
            self.opened = True
            item = output_message("", "in_progress", self.item_id)
            out += self._event("response.output_item.added", output_index=0, item=item)
            part: dict[str, Any] = {"annotations": [], "text": "", "type": "output_text", "logprobs": []}
            out += self._event(
                "response.content_part.added",
                output_index=0,
                item_id=self.item_id,
                content_index=0,
                part=part,
            )
        self.text.append(text)
        loc = {"content_index": 0, "output_index": 0, "item_id": self.item_id}
        return out + self._event("response.output_text.delta", **loc, delta=text, logprobs=[])

    def finish(self, final: dict[str, Any]) -> bytes:
        out = b""
        if self.opened:
            text = "".join(self.text)
            loc = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
            out += self._event("response.output_text.done", **loc, text=text, logprobs=[])
            part: dict[str, Any] = {"annotations": [], "text": text, "type": "output_text", "logprobs": None}
            out += self._event("response.content_part.done", **loc, part=part)
            item = output_message(text, "completed", self.item_id)
            out += self._event("response.output_item.done", output_index=0, item=item)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return out + self._event(kind, response=final)
