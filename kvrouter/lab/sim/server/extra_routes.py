"""The rest of a simulated instance's surface: runtime LoRA adapters, pooling and scoring, transcription.

::

    POST /v1/load_lora_adapter    {lora_name, lora_path, load_inplace}  with runtime LoRA updating on
    POST /v1/unload_lora_adapter  {lora_name}                           (else 404: vLLM has no such route)
    POST /v1/embeddings /pooling /classify /score /v1/score /rerank /v1/rerank /v2/rerank
    POST /v1/audio/transcriptions /v1/audio/translations   (multipart, read as it arrives)

LoRA answers are vLLM's, word for word (a plain-text success, ``InvalidUserInput`` / ``NotFoundError``
errors).  The pooling and audio routes exist only on an instance configured with ``pooling`` (a generative
vLLM model answers them 404): their answers have vLLM's shapes with synthetic values, and a pooling request
runs its prompt through the engine as a one-token request, so its prefix is cached and published as a
pooling model's would be.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from typing import Any

import msgspec
from aiohttp import BodyPartReader, web

from kvrouter.api.errors import BadRequest, NotFound, error_body
from kvrouter.lab.sim.server.instance import SimInstance
from kvrouter.lab.sim.server.routes import INSTANCE, check_alive, json_response, read_json

_encode = msgspec.json.Encoder().encode
NOT_FOUND = b'{"detail":"Not Found"}'
"""What vLLM's HTTP server answers for a route it does not serve."""


def _not_served() -> web.Response:
    return web.Response(body=NOT_FOUND, status=404, content_type="application/json")


def _lora_error(status: int, message: str, err_type: str) -> web.Response:
    return json_response(error_body(status, message, err_type), status)


async def load_lora_adapter(request: web.Request) -> web.Response:
    inst = request.app[INSTANCE]
    if not inst.runtime_lora:
        return _not_served()
    body = await read_json(request)
    name, path = body.get("lora_name"), body.get("lora_path")
    if not isinstance(name, str) or not isinstance(path, str):
        raise BadRequest("'lora_name' and 'lora_path' must be strings")
    if not name or not path:
        return _lora_error(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
    if name == inst.config.model:
        return _lora_error(
            400, f"The lora adapter '{name}' conflicts with a served base model.", "InvalidUserInput"
        )
    if name in inst.adapters and body.get("load_inplace") is not True:
        return _lora_error(
            400,
            f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, "
            "set 'load_inplace' to True.",
            "InvalidUserInput",
        )
    inst.adapters[name] = path
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    inst = request.app[INSTANCE]
    if not inst.runtime_lora:
        return _not_served()
    body = await read_json(request)
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        return _lora_error(
            400, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput"
        )
    if name not in inst.adapters:
        return _lora_error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
    del inst.adapters[name]
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


# ---------------------------------------------------------------------------------------------- pooling
def _vector(tokens: list[int], dims: int = 8) -> list[float]:
    digest = hashlib.blake2b(msgspec.msgpack.encode(tokens), digest_size=dims).digest()
    return [round(b / 255.0 - 0.5, 6) for b in digest]


async def _prefill(request: web.Request, inst: SimInstance, text: str, lora: str | None) -> list[int]:
    """Run ``text`` through the engine (a one-token request: its prefix is cached and published)."""
    tokens = (await inst.tokenizer.aencode_prompt(text)).tokens
    req = inst.submit(
        "pool",
        tokens,
        1,
        rank_header=request.headers.get("X-data-parallel-rank"),
        lora_name=lora,
        ignore_eos=True,
    )
    try:
        while not (await req.next()).finished:
            pass
    finally:
        req.close()
    return tokens


def _texts(body: dict[str, Any], *keys: str) -> list[str]:
    for key in keys:
        v = body.get(key)
        if isinstance(v, str):
            return [v]
        if isinstance(v, list) and v and all(isinstance(x, str) for x in v):
            return list(v)
    raise BadRequest(f"'{keys[0]}' must be a string or a list of strings", param=keys[0])


async def pooling(request: web.Request) -> web.Response:
    """Embeddings, pooling and classification: one vector (or label) per input text."""
    inst = request.app[INSTANCE]
    if not inst.config.pooling:
        return _not_served()
    check_alive(inst)
    body = await read_json(request)
    lora = inst.lora_for(body.get("model") if isinstance(body.get("model"), str) else None)
    texts = _texts(body, "input", "prompt")
    kind = request.path.rsplit("/", 1)[-1]
    data, n = [], 0
    for i, text in enumerate(texts):
        tokens = await _prefill(request, inst, text, lora)
        n += len(tokens)
        vec = _vector(tokens)
        if kind == "embeddings":
            data.append({"index": i, "object": "embedding", "embedding": vec})
        elif kind == "classify":
            p = min(max(vec[0] + 0.5, 0.0), 1.0)
            data.append(
                {
                    "index": i,
                    "label": "LABEL_1" if p >= 0.5 else "LABEL_0",
                    "probs": [1 - p, p],
                    "num_classes": 2,
                }
            )
        else:
            data.append({"index": i, "object": "pooling", "data": vec})
    prefix = {"embeddings": "embd", "classify": "classify"}.get(kind, "pool")
    return json_response(
        _encode(
            {
                "id": f"{prefix}-{uuid.uuid4().hex}",
                "object": "list",
                "created": int(time.time()),
                "model": body.get("model") or inst.config.model,
                "data": data,
                "usage": {
                    "prompt_tokens": n,
                    "total_tokens": n,
                    "completion_tokens": 0,
                    "prompt_tokens_details": None,
                },
            }
        )
    )


async def score(request: web.Request) -> web.Response:
    """Score (``text_1`` against ``text_2``) and rerank (``query`` against ``documents``)."""
    inst = request.app[INSTANCE]
    if not inst.config.pooling:
        return _not_served()
    check_alive(inst)
    body = await read_json(request)
    rerank = "rerank" in request.path
    query = _texts(body, "query" if rerank else "text_1")[0]
    docs = _texts(body, "documents" if rerank else "text_2")
    model = body.get("model") or inst.config.model
    n = 0
    scores = []
    for doc in docs:
        tokens = await _prefill(request, inst, query + "\n" + doc, None)
        n += len(tokens)
        scores.append(round(_vector(tokens)[0] + 0.5, 6))
    rid = f"{'rerank' if rerank else 'score'}-{uuid.uuid4().hex}"
    if rerank:
        results = [
            {"index": i, "document": {"text": d}, "relevance_score": s}
            for i, (d, s) in enumerate(zip(docs, scores))
        ]
        results.sort(key=lambda r: -float(r["relevance_score"]))  # type: ignore[arg-type]
        top = body.get("top_n")
        if isinstance(top, int) and top > 0:
            results = results[:top]
        return json_response(
            _encode({"id": rid, "model": model, "usage": {"total_tokens": n}, "results": results})
        )
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    out = {"id": rid, "object": "list", "created": int(time.time()), "model": model, "data": data}
    return json_response(
        _encode({**out, "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}})
    )


async def transcription(request: web.Request) -> web.Response:
    """A multipart audio upload, read part by part as it arrives (``audio_bytes_seen`` grows meanwhile)."""
    inst = request.app[INSTANCE]
    if not inst.config.pooling:
        return _not_served()
    check_alive(inst)
    reader = await request.multipart()
    model: str | None = None
    size = 0
    inst.audio_bytes_seen = 0
    while (part := await reader.next()) is not None:
        if not isinstance(part, BodyPartReader):
            continue
        if part.name == "model":
            model = (await part.text()).strip()
        elif part.name == "file":
            while chunk := await part.read_chunk(1 << 16):
                size += len(chunk)
                inst.audio_bytes_seen = size
        else:
            await part.release()
    if size == 0:
        raise BadRequest("an audio 'file' part is required", param="file")
    if model is not None and model != inst.config.model and model not in inst.adapters:
        raise NotFound(f"The model `{model}` does not exist.", param="model")
    words = " ".join(inst.vocab.text([int(inst.vocab.word_ids[size % len(inst.vocab.word_ids)])]).split())
    return json_response(
        _encode({"text": f"{words} ({size} bytes)", "usage": {"type": "duration", "seconds": 1}})
    )
