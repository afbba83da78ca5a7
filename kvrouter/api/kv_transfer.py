"""``kv_transfer_params``: how a request is split over a prefill and a decode instance (vLLM 0.33, NIXL
connector, pull mode), written once for the gateway (which rewrites the two legs) and the simulated vLLM
(which answers them).

::

    client body ──prefill_leg_body──▶ prefill instance: max_tokens 1, no stream, PREFILL_REQUEST params
                                          │ answer: kv_transfer_params (PrefillAnswerParams, 0.33 fields)
    client body ──decode_leg_body(params verbatim)──▶ decode instance: pulls the blocks, streams the answer

vLLM reads ``kv_transfer_params`` from the body of a completion, chat or Responses request and returns the
prefill instance's in its answer's ``kv_transfer_params``.  The decode instance reports the prefill
instance's cached tokens (``remote_prefill_cached_tokens``) as its own ``cached_tokens``, so the client
sees one request's usage.
"""

from __future__ import annotations

from typing import Any, Literal, cast, get_args

import msgspec

LegKind = Literal["completions", "chat", "responses"]
"""The routes vLLM 0.33's P/D proxy splits; every other kind is served whole."""


_LEG_KINDS = frozenset(get_args(LegKind))


def leg_kind(kind: str) -> LegKind | None:
    """``kind`` as a splittable route, or None when requests of that kind are served whole."""
    return cast(LegKind, kind) if kind in _LEG_KINDS else None


PREFILL_REQUEST: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""What a prefill leg carries: decode elsewhere, hold the blocks for it."""

_NOT_ON_PREFILL = ("stream_options", "min_tokens", "min_completion_tokens")
"""Fields a prefill leg drops: no stream to shape, and a one-token answer cannot honour a minimum."""


def prefill_leg_body(body: dict[str, Any], kind: LegKind) -> dict[str, Any]:
    """The prefill leg of a client's request: one token, not streamed, asking the instance to hold the
    prompt's KV cache for a decode instance.  ``body`` is left as it was."""
    out = {k: v for k, v in body.items() if k not in _NOT_ON_PREFILL}
    out["stream"] = False
    out["kv_transfer_params"] = dict(PREFILL_REQUEST)
    if kind == "responses":
        out["max_output_tokens"] = 1
    else:
        out["max_tokens"] = 1
        if "max_completion_tokens" in out:
            out["max_completion_tokens"] = 1
    return out


def decode_leg_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The decode leg: the client's request as it sent it (its streaming too), with the prefill
    instance's ``kv_transfer_params`` copied verbatim."""
    out = dict(body)
    out["kv_transfer_params"] = params
    return out


def answer_params(answer: bytes) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` of a prefill leg's (unstreamed) answer, or None if it has none usable:
    an instance without a KV connector answers null, and the request can only be served whole."""
    try:
        obj = msgspec.json.decode(answer)
    except msgspec.DecodeError:
        return None
    params = obj.get("kv_transfer_params") if isinstance(obj, dict) else None
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        return None
    return params


class PrefillAnswerParams(msgspec.Struct, frozen=True):
    """A prefill instance's ``kv_transfer_params`` in vLLM 0.33 (NIXL pull scheduler's
    ``request_finished``, plus the scheduler's ``remote_prefill_cached_tokens``), in its field order."""

    do_remote_prefill: bool
    do_remote_decode: bool
    remote_block_ids: list[list[int]]
    """Per KV-cache group, the blocks the prompt occupies (one group for full attention)."""
    remote_engine_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int
    tp_size: int
    dcp_size: int
    pp_size: int
    remote_num_tokens: int
    """Tokens computed on the prefill instance (the prompt)."""
    remote_blocks_expiry_time: float | None
    """Set by a decode instance that keeps blocks for a later turn; a prefill instance sends null."""
    remote_registration_generation: int
    transfer_mode: str
    remote_prefill_cached_tokens: int
    """The prefill instance's prefix-cache hit: what the decode instance reports as ``cached_tokens``."""


class DecodeRequestParams(msgspec.Struct, frozen=True):
    """What a decode instance reads of the ``kv_transfer_params`` it is given (vLLM requires the first
    five for a transfer and warns, then computes the prompt itself, without them)."""

    remote_engine_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int
    remote_block_ids: list[list[int]]
    remote_num_tokens: int = 0
    remote_prefill_cached_tokens: int | None = None


def decode_request(params: dict[str, Any] | None) -> DecodeRequestParams | None:
    """A decode leg's transfer, if ``params`` asks for one (``do_remote_prefill``) and names its source;
    None otherwise (no transfer: the instance computes the prompt)."""
    if not params or not params.get("do_remote_prefill"):
        return None
    try:
        return msgspec.convert(params, DecodeRequestParams)
    except msgspec.ValidationError:
        return None


def is_prefill_request(params: dict[str, Any] | None) -> bool:
    """Whether a request is a prefill leg (its blocks are to be held for a decode instance)."""
    return bool(params and params.get("do_remote_decode"))
