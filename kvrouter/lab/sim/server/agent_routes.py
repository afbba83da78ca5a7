"""The agent APIs of a simulated instance: the Responses API and Anthropic's Messages API, served the way
vLLM 0.33 serves them for a text model.

``POST /v1/responses``: a ``previous_response_id`` continues the stored conversation (404 if not held);
the prompt is the tokens vLLM's Responses path renders (``CachedTokenizer.aencode_responses_request``);
the answer is a response object or its SSE events, stored when asked and
VLLM_ENABLE_RESPONSES_API_STORE is on (``background``: answered "queued" at once, read with GET).
``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel`` read and cancel stored ones.
``POST /v1/messages`` renders as vLLM's Messages path; ``/v1/messages/count_tokens`` gives its length.

A continued conversation re-sends its whole history to the engine, which finds the earlier turns in its
prefix cache: the cached tokens reported grow turn by turn, as on vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any

import msgspec
from aiohttp import web

from kvrouter.api import messages as anth
from kvrouter.api.errors import ApiError, BadRequest
from kvrouter.api.kv_transfer import decode_request, is_prefill_request
from kvrouter.api.responses import (
    ResponseNotFound,
    ResponsesArgs,
    ResponseStream,
    output_message,
    parse_responses_args,
    response_object,
    responses_usage,
)
from kvrouter.lab.sim.server.instance import EngineCrashed, InFlight, SimInstance
from kvrouter.lab.sim.server.routes import INSTANCE, check_alive, drop_connection, json_response, read_json
from tokenizer_cache import TokenizerCacheError
from tokenizer_cache.agent_inputs import AgentInputError, responses_messages

_encode_json = msgspec.json.Encoder().encode


class RenderedResponses:
    """A Responses request as this instance renders it: its prompt tokens, and the chat messages stored
    for a later ``previous_response_id``."""

    __slots__ = ("messages", "tokens")

    def __init__(self, messages: list[dict[str, Any]], tokens: list[int]) -> None:
        self.messages = messages
        self.tokens = tokens


def _submit(
    request: web.Request, inst: SimInstance, tokens: list[int], limit: int | None, **kw: Any
) -> InFlight:
    return inst.submit("resp", tokens, limit, rank_header=request.headers.get("X-data-parallel-rank"), **kw)


# ---------------------------------------------------------------------------------------------- Responses
async def _render(inst: SimInstance, args: ResponsesArgs) -> RenderedResponses:
    prev_messages = prev_output = None
    if args.previous_response_id is not None:
        held = inst.responses.get(args.previous_response_id) if inst.store_responses else None
        if held is None:
            raise ResponseNotFound(args.previous_response_id)
        prev_messages, prev_output = held.messages, held.response["output"]
    body = args.body
    if inst.faults.render_fault:  # rendered as by an instance with another template: a system line first
        body = {
            **body,
            "instructions": "[rendered by another template]" + str(body.get("instructions") or ""),
        }
    try:
        messages = responses_messages(
            args.body.get("instructions"),
            args.body.get("input"),
            previous_messages=prev_messages,
            previous_output=prev_output,
        )
        enc = await inst.tokenizer.aencode_responses_request(
            body, previous_messages=prev_messages, previous_output=prev_output
        )
    except AgentInputError as e:
        raise BadRequest(str(e), param=e.param) from None
    except TokenizerCacheError as e:
        raise BadRequest(str(e)) from None
    return RenderedResponses(messages, enc.tokens)


async def create_response(request: web.Request) -> web.StreamResponse:
    inst = request.app[INSTANCE]
    check_alive(inst)
    args = parse_responses_args(await read_json(request))
    lora = inst.lora_for(args.model)
    if args.background and args.store and not inst.store_responses:
        raise BadRequest(
            "This vLLM engine does not support `store=True` and therefore does not support the background "
            "mode. To enable these features, set the environment variable "
            "`VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server.",
            param="background",
        )
    if args.background and args.stream:
        raise BadRequest("the simulated vLLM instance does not stream background responses", param="stream")
    rendered = await _render(inst, args)
    tokens = rendered.tokens
    if len(tokens) >= inst.max_model_len:
        raise BadRequest(
            f"The engine prompt length {len(tokens)} exceeds the max_model_len {inst.max_model_len}. "
            "Please reduce prompt.",
            param="input",
        )
    store = args.store and inst.store_responses
    model = args.model or inst.config.model
    limit = inst.max_model_len - len(tokens)
    if args.max_output_tokens is not None:
        limit = min(limit, args.max_output_tokens)
    created = int(time.time())
    if inst.faults.latency_s:
        await asyncio.sleep(inst.faults.latency_s)
    if inst.faults.crashed:
        return drop_connection(request)
    params = args.kv_transfer_params if inst.config.kv_transfer.enabled else None
    hold = is_prefill_request(params)
    req = _submit(
        request, inst, tokens, limit, cache_salt=args.cache_salt, lora_name=lora, seed=args.seed,
        ignore_eos=args.ignore_eos, request_id=request.headers.get("X-Request-Id"), hold=hold,
        pull=None if hold else decode_request(params),
    )  # fmt: skip
    if args.background:
        queued = response_object(args, model, created, "queued", [], limit, None)
        inst.responses.put(args.request_id, queued, rendered.messages)
        task = asyncio.create_task(_run_background(inst, req, args, model, created, limit, rendered))
        inst.background[args.request_id] = task
        task.add_done_callback(lambda _: inst.background.pop(args.request_id, None))
        return json_response(_encode_json(queued))
    resp: web.StreamResponse | None = None
    try:
        if not args.stream:
            final = await _collect(inst, req, args, model, created, limit)
            if store:
                inst.responses.put(args.request_id, final, rendered.messages)
            return json_response(_encode_json(final))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        stream = ResponseStream(response_object(args, model, created, "in_progress", [], limit, None))
        await resp.write(stream.start())
        while True:
            out = await req.next()
            await resp.write(stream.delta("".join(inst.vocab.piece(t) for t in out.new_token_ids)))
            if out.finished:
                break
        final = _final(args, model, created, limit, req, "".join(stream.text))
        if store:
            inst.responses.put(args.request_id, final, rendered.messages)
        await resp.write(stream.finish(final))
        await resp.write_eof()
        return resp
    except EngineCrashed:
        return drop_connection(request, resp)
    except ConnectionResetError:
        return resp or web.Response()
    finally:
        req.close()  # a prefill leg whose answer named no blocks frees them here
        inst.transfers.forget(req.request_id)


def _final(
    args: ResponsesArgs, model: str, created: int, limit: int, req: InFlight, text: str
) -> dict[str, Any]:
    status = "incomplete" if req.finish_reason == "length" else "completed"
    output = [output_message(text, status)] if text else []
    use = responses_usage(req.num_prompt, req.cached_tokens, req.num_output)
    return response_object(args, model, created, status, output, limit, use)


def _lease(inst: SimInstance, req: InFlight, final: dict[str, Any]) -> dict[str, Any]:
    """A prefill leg's answer names the blocks it holds (``kv_transfer_params``, as vLLM's Responses
    serving copies its output's); any other answer is returned as it was."""
    return {**final, "kv_transfer_params": inst.lease(req)} if req.hold else final


async def _collect(
    inst: SimInstance, req: InFlight, args: ResponsesArgs, model: str, created: int, limit: int
) -> dict[str, Any]:
    ids: list[int] = []
    while True:
        out = await req.next()
        ids.extend(out.new_token_ids)
        if out.finished:
            return _lease(inst, req, _final(args, model, created, limit, req, inst.vocab.text(ids)))


async def _run_background(
    inst: SimInstance,
    req: InFlight,
    args: ResponsesArgs,
    model: str,
    created: int,
    limit: int,
    rendered: RenderedResponses,
) -> None:
    held = inst.responses.get(args.request_id)
    if held is not None:
        held.response = {**held.response, "status": "in_progress"}
    try:
        final = await _collect(inst, req, args, model, created, limit)
    except (EngineCrashed, asyncio.CancelledError):
        return
    finally:
        req.close()
    held = inst.responses.get(args.request_id)
    if held is None or held.response["status"] != "cancelled":
        inst.responses.put(args.request_id, final, rendered.messages)


async def get_response(request: web.Request) -> web.Response:
    inst = request.app[INSTANCE]
    rid = request.match_info["response_id"]
    held = inst.responses.get(rid)
    if held is None:
        raise ResponseNotFound(rid)
    if request.query.get("stream", "false").lower() in ("1", "true"):
        raise BadRequest("the simulated vLLM instance does not replay response streams", param="stream")
    return json_response(_encode_json(held.response))


async def cancel_response(request: web.Request) -> web.Response:
    inst = request.app[INSTANCE]
    rid = request.match_info["response_id"]
    held = inst.responses.get(rid)
    if held is None:
        raise ResponseNotFound(rid)
    if held.response["status"] not in ("queued", "in_progress"):
        e = BadRequest("Cannot cancel a synchronous response.", param="response_id")
        e.err_type = "invalid_request_error"
        raise e
    held.response = {**held.response, "status": "cancelled"}
    task = inst.background.get(rid)
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    return json_response(_encode_json(held.response))


# ---------------------------------------------------------------------------------------------- Messages
async def _messages_tokens(inst: SimInstance, body: dict[str, Any], count_tokens: bool = False) -> list[int]:
    if inst.faults.render_fault:
        msgs = body.get("messages")
        extra = [{"role": "user", "content": "[rendered by another template]"}]
        body = {**body, "messages": extra + (msgs if isinstance(msgs, list) else [])}
    try:
        enc = await inst.tokenizer.aencode_messages_request(body, count_tokens=count_tokens)
    except AgentInputError as e:
        raise BadRequest(str(e), param=e.param) from None
    except TokenizerCacheError as e:
        raise BadRequest(str(e)) from None
    return enc.tokens


async def messages(request: web.Request) -> web.StreamResponse:
    inst = request.app[INSTANCE]
    check_alive(inst)
    args = anth.parse_messages_args(await read_json(request))
    lora = inst.lora_for(args.model)
    tokens = await _messages_tokens(inst, args.body)
    if inst.faults.latency_s:
        await asyncio.sleep(inst.faults.latency_s)
    if inst.faults.crashed:
        return drop_connection(request)
    req = _submit(request, inst, tokens, args.max_tokens, cache_salt=args.cache_salt, lora_name=lora)
    mid = f"chatcmpl-{uuid.uuid4().hex}"
    resp: web.StreamResponse | None = None
    try:
        if not args.stream:
            ids: list[int] = []
            while True:
                out = await req.next()
                ids.extend(out.new_token_ids)
                if out.finished:
                    break
            use = anth.anthropic_usage(req.num_prompt, req.cached_tokens, req.num_output)
            return json_response(
                anth.message_body(mid, args.model, inst.vocab.text(ids), req.finish_reason, use)
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        opened = False
        while True:
            out = await req.next()
            if not opened:
                start_use = anth.anthropic_usage(req.num_prompt, req.cached_tokens, 0)
                await resp.write(anth.message_start(mid, args.model, start_use))
                block = {"index": 0, "content_block": {"type": "text", "text": ""}}
                await resp.write(anth.event("content_block_start", block))
                opened = True
            text = "".join(inst.vocab.piece(t) for t in out.new_token_ids)
            if text:
                delta = {"index": 0, "delta": {"type": "text_delta", "text": text}}
                await resp.write(anth.event("content_block_delta", delta))
            if out.finished:
                break
        await resp.write(anth.event("content_block_stop", {"index": 0}))
        use = anth.anthropic_usage(req.num_prompt, req.cached_tokens, req.num_output)
        stop = {"stop_reason": anth.stop_reason(req.finish_reason), "stop_sequence": None}
        await resp.write(anth.event("message_delta", {"delta": stop, "usage": use}))
        await resp.write(anth.event("message_stop", {}))
        await resp.write_eof()
        return resp
    except EngineCrashed:
        return drop_connection(request, resp)
    except ConnectionResetError:
        return resp or web.Response()
    finally:
        req.close()


async def count_tokens(request: web.Request) -> web.Response:
    inst = request.app[INSTANCE]
    args = anth.parse_messages_args(await read_json(request), count=True)
    inst.lora_for(args.model)
    return json_response(anth.count_body(len(await _messages_tokens(inst, args.body, count_tokens=True))))


@web.middleware
async def anthropic_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """vLLM answers every error of the Messages routes in Anthropic's shape."""
    try:
        resp: web.StreamResponse = await handler(request)
        return resp
    except (ApiError, TokenizerCacheError) as e:
        if not request.path.startswith("/v1/messages"):
            raise
        status, message = (e.status, e.message) if isinstance(e, ApiError) else (400, str(e))
        return json_response(anth.anthropic_error_body(status, message), status)
