"""The OpenAI generation routes of a simulated instance: ``/v1/completions`` and ``/v1/chat/completions``.

::

    body ──▶ parse ──▶ tokenize (tokenizer cache, off the loop) ──▶ vLLM's API server (modelled, from arrival)
        ──▶ [latency fault] ──▶ SimInstance.submit
        ──▶ one JSON answer when the request finishes, or SSE: a chunk per engine step that produced a token
            (chat: the role chunk with the first output, as vLLM), the finish chunk, usage, ``data: [DONE]``

A client that disconnects cancels its handler (``handler_cancellation``); ``InFlight.close()`` in the
``finally`` then aborts its request in the engine.  A crash ends the request by cutting the connection.

``kv_transfer_params`` (``api.kv_transfer``) make a request a prefill leg (its blocks are held, and its
answer names them) or a decode leg (its prompt is pulled from the prefill instance; its usage reports the
prefill instance's cached tokens), unless the instance's KV connector is off.  ``X-Request-Id`` is the base
of the request's id, as in vLLM.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from aiohttp import web

from kvrouter.api.bodies import (
    SSE_DONE,
    chat_body,
    chat_chunk,
    completion_body,
    completion_chunk,
    usage_chunk,
)
from kvrouter.api.errors import BadRequest
from kvrouter.api.kv_transfer import decode_request, is_prefill_request
from kvrouter.api.requests import ChatArgs, CompletionArgs, parse_chat, parse_completion
from kvrouter.api.usage import usage
from kvrouter.lab.sim.server.instance import EngineCrashed, InFlight, SimInstance
from kvrouter.lab.sim.server.routes import INSTANCE, check_alive, drop_connection, json_response, read_json


# ---------------------------------------------------------------------------------------------- OpenAI
async def completions(request: web.Request) -> web.StreamResponse:
    arrived = time.monotonic()
    inst = request.app[INSTANCE]
    check_alive(inst)
    args = parse_completion(await read_json(request))
    lora = inst.lora_for(args.model)
    tokens = await inst.tokenizer.aencode_prompt(args.prompt)
    await inst.api_server(arrived, len(tokens), "completion" if isinstance(args.prompt, str) else "token_ids")
    return await _generate(request, inst, "cmpl", tokens, args, lora)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    arrived = time.monotonic()
    inst = request.app[INSTANCE]
    check_alive(inst)
    body = await read_json(request)
    args = parse_chat(body)
    lora = inst.lora_for(args.model)
    enc = await inst.encode_chat_ex(body)
    tokens = enc.tokens
    if not enc.complete:  # media the simulator cannot expand (an http(s) URL): vLLM would fetch it
        raise BadRequest("the simulated instance cannot load this media item", param="messages")
    await inst.api_server(arrived, len(tokens), "chat")
    return await _generate(request, inst, "chatcmpl", tokens, args, lora, enc.mm)


async def _generate(
    request: web.Request,
    inst: SimInstance,
    prefix: str,
    tokens: list[int],
    args: CompletionArgs | ChatArgs,
    lora: str | None,
    mm_items: Sequence[tuple[str, int, int]] = (),
) -> web.StreamResponse:
    if inst.faults.latency_s:
        await asyncio.sleep(inst.faults.latency_s)
    if inst.faults.crashed:
        return drop_connection(request)
    params = args.kv_transfer_params if inst.config.kv_transfer.enabled else None
    hold = is_prefill_request(params)
    req = inst.submit(
        prefix,
        tokens,
        args.max_tokens,
        rank_header=request.headers.get("X-data-parallel-rank"),
        cache_salt=args.cache_salt,
        lora_name=lora,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        request_id=request.headers.get("X-Request-Id"),
        hold=hold,
        pull=None if hold else decode_request(params),
        mm_items=mm_items,
    )
    model = args.model or inst.config.model
    chat = isinstance(args, ChatArgs)
    resp: web.StreamResponse | None = None
    try:
        if not args.stream:
            return await _collect(inst, req, model, chat)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        await _stream(resp, inst, req, args, model, chat)
        return resp
    except EngineCrashed:
        return drop_connection(request, resp)
    except ConnectionResetError:  # the client left between two chunks; aiohttp drops the rest quietly
        return resp or web.Response()
    finally:
        req.close()  # a request still in the engine (its client gone) is aborted there
        inst.transfers.forget(req.request_id)


async def _collect(inst: SimInstance, req: InFlight, model: str, chat: bool) -> web.Response:
    ids: list[int] = []
    while True:
        out = await req.next()
        ids.extend(out.new_token_ids)
        if out.finished:
            break
    use = usage(req.num_prompt, out.num_output_tokens, req.cached_tokens)
    kv = inst.lease(req)  # a prefill leg names its blocks (no await since it finished)
    build = chat_body if chat else completion_body
    return json_response(
        build(req.request_id, int(time.time()), model, inst.vocab.text(ids), req.finish_reason, use, kv)
    )


async def _stream(
    resp: web.StreamResponse,
    inst: SimInstance,
    req: InFlight,
    args: CompletionArgs | ChatArgs,
    model: str,
    chat: bool,
) -> None:
    """SSE: one chunk per engine step that produced a token, as vLLM streams."""
    rid, created, piece = req.request_id, int(time.time()), inst.vocab.piece
    first = True
    while True:
        out = await req.next()
        finish = req.finish_reason if out.finished else None
        use = (
            usage(req.num_prompt, out.num_output_tokens, req.cached_tokens) if args.continuous_usage else None
        )
        text = "".join(piece(t) for t in out.new_token_ids)
        if chat:
            if first:  # vLLM sends the role with the first engine output
                await resp.write(
                    chat_chunk(rid, created, model, {"role": "assistant", "content": ""}, None, use)
                )
                first = False
            chunk = chat_chunk(rid, created, model, {"content": text}, finish, use)
        else:
            chunk = completion_chunk(rid, created, model, text, finish, use)
        await resp.write(chunk)
        if out.finished:
            break
    if args.include_usage:
        kind = "chat.completion.chunk" if chat else "text_completion"
        total = usage(req.num_prompt, out.num_output_tokens, req.cached_tokens)
        await resp.write(usage_chunk(rid, created, model, kind, total))
    await resp.write(SSE_DONE)
    await resp.write_eof()
