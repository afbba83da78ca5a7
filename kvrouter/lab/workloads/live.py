"""The live path: turning workload requests into real HTTP requests through a real tokenizer.

::

    make_workload("sglang-gsp", form="chat")  --materialize(w, tokenize)-->  token_ids filled
          |                                                                    |
          '-- http_request(r) -> POST /v1/chat/completions {"messages": ...}   '-- kvrouter eval (same ids)

``materialize`` fills ``token_ids`` of text requests with the caller's tokenizer (for example the tokenizer
cache's ``encode_chat_request`` / ``encode_prompt``), so the simulation sees the very tokens the
served model will see; that is what makes live and simulated hit rates comparable.  Token-only requests
(Mooncake, tokens form) need no tokenizer: they are sent as ``prompt: [ids]`` to ``/v1/completions``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
from msgspec import Struct

from kvrouter.lab.workloads.errors import NotMaterialized
from kvrouter.lab.workloads.spec import Request, TokenSpace, Workload
from kvrouter.lab.workloads.tokens import prompt_ids

Tokenize = Callable[[Request], list[int]]
"""Maps a text request (``text`` or ``messages`` set) to the served model's prompt token ids."""

AFFINITY_HEADER = "X-Amzn-SageMaker-Prefix-Aware-Id"
"""SageMaker's affinity header; the OpenAI-style equivalent is the body field ``prompt_cache_key``."""


def tokenize_with(
    encode_prompt: Callable[[str], list[int]],
    encode_chat: Callable[[list[dict[str, str]]], list[int]] | None = None,
) -> Tokenize:
    """A ``Tokenize`` from a tokenizer's two entry points: completion text through ``encode_prompt``, chat
    messages (as OpenAI dicts) through ``encode_chat`` (the chat template included; with the tokenizer
    cache, ``encode_chat_request`` of ``tokenizer_cache.chat_body(messages)``)."""

    def tokenize(request: Request) -> list[int]:
        if request.messages is not None:
            if encode_chat is None:
                raise NotMaterialized(f"request {request.id} is a chat request and no encode_chat was given")
            return encode_chat([{"role": m.role, "content": m.content} for m in request.messages])
        if request.text is None:
            raise NotMaterialized(f"request {request.id} has no text to tokenize")
        return encode_prompt(request.text)

    return tokenize


def materialize(workload: Workload, tokenize: Tokenize) -> Workload:
    """The workload with every text request's ``token_ids`` and ``num_prompt_tokens`` from ``tokenize``.

    Text and messages are kept (the live path still sends them); requests that already have token ids
    or segments are left alone."""
    requests = []
    for req in workload.requests:
        if req.token_ids is None and not req.segments and (req.text is not None or req.messages is not None):
            ids = list(tokenize(req))
            req = msgspec.structs.replace(req, token_ids=ids, num_prompt_tokens=len(ids))
        requests.append(req)
    return msgspec.structs.replace(
        workload, requests=requests, metadata={**workload.metadata, "materialized": True}
    )


class HttpCall(Struct, frozen=True):
    """One OpenAI-compatible request, ready to send."""

    path: str
    """``/v1/chat/completions`` or ``/v1/completions``."""
    body: dict[str, Any]
    headers: dict[str, str]


def http_call(
    request: Request,
    space: TokenSpace,
    *,
    model: str,
    stream: bool = True,
    affinity_header: bool = True,
    send_ids: bool = False,
) -> HttpCall:
    """The HTTP request that sends ``request`` to vLLM (directly or through the gateway).

    ``ignore_eos`` makes vLLM generate exactly ``max_tokens``, as the simulation assumes; ``cache_salt``
    is vLLM's; the affinity id travels as ``prompt_cache_key`` and (unless ``affinity_header=False``) as
    SageMaker's header.  A completion request with text sends the text (the gateway tokenizes it) unless
    ``send_ids``; one without text sends its token ids.  Chat requests always send their messages."""
    body: dict[str, Any] = {"model": model, "max_tokens": request.max_output_tokens, "ignore_eos": True}
    if request.messages is not None:
        path = "/v1/chat/completions"
        body["messages"] = [msgspec.to_builtins(m) for m in request.messages]
    else:
        path = "/v1/completions"
        use_text = request.text is not None and not send_ids
        body["prompt"] = request.text if use_text else prompt_ids(request, space)
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    if request.cache_salt is not None:
        body["cache_salt"] = request.cache_salt
    headers: dict[str, str] = {}
    if request.affinity_id is not None:
        body["prompt_cache_key"] = request.affinity_id
        if affinity_header:
            headers[AFFINITY_HEADER] = request.affinity_id
    return HttpCall(path, body, headers)
