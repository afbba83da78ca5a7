"""Decoding vLLM's KV-event payloads, every release from 0.9 to 0.33.

A payload (frame 2 of a ZeroMQ message) is one msgpack batch: ``[ts, events]`` (0.9), ``[ts, events,
data_parallel_rank]`` (0.10 and later; a map is tolerated too).  ``events[i]`` is positional
``[tag, f1, ...]`` (<= 0.23, every field present) or a map ``{"type": tag, ...}`` (>= 0.24, None fields
omitted).

msgspec cannot decode both shapes with one typed union, so the events array is kept raw, its first
element's header byte picks the shape, and the list is decoded in one typed call.  If that fails, the
list is decoded event by event so one bad event costs only itself: skipped and counted by reason.
``token_ids`` stays raw msgpack (``indexer.hashing`` hashes it in one compiled pass).  Fields are only
ever appended across releases: every later field has a default, unknown keys and extra trailing
elements are ignored.
"""

from __future__ import annotations

import struct
from collections import Counter
from typing import Any

import msgspec

from .errors import DecodeError

Hash = int | bytes


class _StoredFields(msgspec.Struct, gc=False):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None = None
    token_ids: msgspec.Raw = msgspec.Raw(b"\x90")  # kept as msgpack: hashed without making Python ints
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None  # 0.26: LOCAL / REMOTE relative to the publisher
    ownership: str | None = None  # 0.30: the secondary tier that wrote the block


class _RemovedFields(msgspec.Struct, gc=False):
    block_hashes: list[Hash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _ClearedFields(msgspec.Struct, gc=False):
    pass


class _PStored(_StoredFields, array_like=True, tag="BlockStored"):
    pass


class _PRemoved(_RemovedFields, array_like=True, tag="BlockRemoved"):
    pass


class _PCleared(_ClearedFields, array_like=True, tag="AllBlocksCleared"):
    pass


class _MStored(_StoredFields, tag="BlockStored"):
    pass


class _MRemoved(_RemovedFields, tag="BlockRemoved"):
    pass


class _MCleared(_ClearedFields, tag="AllBlocksCleared"):
    pass


BlockStored = _StoredFields
BlockRemoved = _RemovedFields
AllBlocksCleared = _ClearedFields
Event = _StoredFields | _RemovedFields | _ClearedFields

_PUnion = _PStored | _PRemoved | _PCleared
_MUnion = _MStored | _MRemoved | _MCleared


class _BatchArray(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: msgspec.Raw
    data_parallel_rank: int | None = None


class _BatchMap(msgspec.Struct, gc=False):
    ts: float
    events: msgspec.Raw
    data_parallel_rank: int | None = None


class _BatchPositional(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_PUnion]
    data_parallel_rank: int | None = None


class _BatchMapped(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_MUnion]
    data_parallel_rank: int | None = None


class DecodedBatch(msgspec.Struct, gc=False):
    """One decoded batch.  ``skipped`` counts events dropped while decoding, by reason."""

    ts: float
    events: list[Event]
    dp_rank: int | None
    skipped: Counter[str]


_F64 = struct.Struct(">d")
_KNOWN_TAGS = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})


def _is_array_header(b: int) -> bool:
    return 0x90 <= b <= 0x9F or b in (0xDC, 0xDD)


def _is_map_header(b: int) -> bool:
    return 0x80 <= b <= 0x8F or b in (0xDE, 0xDF)


def _list_header_len(b: int) -> int:
    if 0x90 <= b <= 0x9F:
        return 1
    if b == 0xDC:
        return 3
    if b == 0xDD:
        return 5
    raise DecodeError("events_shape", "events is not an array")


class BatchDecoder:
    """Decodes raw payloads.  Build one per consumer and reuse it (msgspec decoders are built once)."""

    def __init__(self) -> None:
        self._fast_p = msgspec.msgpack.Decoder(_BatchPositional)
        self._fast_m = msgspec.msgpack.Decoder(_BatchMapped)
        self._batch_array = msgspec.msgpack.Decoder(_BatchArray)
        self._batch_map = msgspec.msgpack.Decoder(_BatchMap)
        self._p_list = msgspec.msgpack.Decoder(list[_PUnion])
        self._m_list = msgspec.msgpack.Decoder(list[_MUnion])
        self._p_one = msgspec.msgpack.Decoder(_PUnion)
        self._m_one = msgspec.msgpack.Decoder(_MUnion)
        self._raw_list = msgspec.msgpack.Decoder(list[msgspec.Raw])
        self._any = msgspec.msgpack.Decoder()

    def decode(self, payload: bytes) -> DecodedBatch:
        """Decode one payload.  Raises ``DecodeError`` if the batch itself is unusable."""
        if not payload:
            raise DecodeError("empty")
        # Fast path: one typed pass over the common shape ``[ts: float64, [events...], rank]``.  (Raw
        # fields cost a full skip over their bytes, so decoding events raw first would walk tokens twice.)
        shape = _peek_event_shape(payload)
        if shape is not None:
            try:
                fast = (self._fast_m if shape else self._fast_p).decode(payload)
            except _MALFORMED:
                pass
            else:
                if _rank_ok(fast.data_parallel_rank):
                    return DecodedBatch(fast.ts, list(fast.events), fast.data_parallel_rank, Counter())
        first = payload[0]
        try:
            if _is_array_header(first):
                batch: _BatchArray | _BatchMap = self._batch_array.decode(payload)
            elif _is_map_header(first):
                batch = self._batch_map.decode(payload)
            else:
                raise DecodeError("batch_shape", f"first byte 0x{first:02x}")
        except _MALFORMED as e:
            raise DecodeError(_reason(e, "batch_shape"), str(e)[:200]) from None
        rank = batch.data_parallel_rank
        if not _rank_ok(rank):
            raise DecodeError("batch_shape", f"data_parallel_rank {rank} outside 0..{MAX_DP_RANK}")
        events, skipped = self._decode_events(bytes(batch.events))
        return DecodedBatch(batch.ts, events, rank, skipped)

    def decode_rank(self, payload: bytes) -> int | None:
        """Only the batch's ``data_parallel_rank`` (cheap: events stay raw)."""
        if not payload:
            raise DecodeError("empty")
        try:
            if _is_array_header(payload[0]):
                rank = self._batch_array.decode(payload).data_parallel_rank
            elif _is_map_header(payload[0]):
                rank = self._batch_map.decode(payload).data_parallel_rank
            else:
                raise DecodeError("batch_shape", f"first byte 0x{payload[0]:02x}")
        except _MALFORMED as e:
            raise DecodeError(_reason(e, "batch_shape"), str(e)[:200]) from None
        if not _rank_ok(rank):
            raise DecodeError("batch_shape", f"data_parallel_rank {rank} outside 0..{MAX_DP_RANK}")
        return rank

    def _decode_events(self, raw: bytes) -> tuple[list[Event], Counter[str]]:
        skipped: Counter[str] = Counter()
        if not raw:
            raise DecodeError("events_shape", "missing events")
        hdr = _list_header_len(raw[0])
        if len(raw) <= hdr:
            return [], skipped
        elem = raw[hdr]
        whole = self._p_list if _is_array_header(elem) else self._m_list
        try:
            return list(whole.decode(raw)), skipped
        except _MALFORMED:
            pass
        # Slow path: isolate the bad events.
        try:
            parts = self._raw_list.decode(raw)
        except _MALFORMED as e:
            raise DecodeError(_reason(e, "events_shape"), str(e)[:200]) from None
        out: list[Event] = []
        for part in parts:
            ev = self._decode_one(bytes(part), skipped)
            if ev is not None:
                out.append(ev)
        return out, skipped

    def _decode_one(self, raw: bytes, skipped: Counter[str]) -> Event | None:
        if not raw:
            skipped["bad_event"] += 1
            return None
        one = self._p_one if _is_array_header(raw[0]) else self._m_one
        try:
            return one.decode(raw)
        except _MALFORMED as e:
            skipped[self._why(raw) if isinstance(e, msgspec.ValidationError) else _reason(e, "")] += 1
        return None

    def _why(self, raw: bytes) -> str:
        """Tell an unknown tag (a newer vLLM's event: expected, harmless) from a malformed event."""
        try:
            obj = self._any.decode(raw)
        except _MALFORMED as e:
            return _reason(e, "bad_event")
        tag = None
        if isinstance(obj, list) and obj:
            tag = obj[0]
        elif isinstance(obj, dict):
            tag = obj.get("type")
        if isinstance(tag, str) and tag not in _KNOWN_TAGS:
            return "unknown_tag"
        return "bad_event"


MAX_DP_RANK = (1 << 16) - 1
"""Largest ``data_parallel_rank`` accepted.  No deployment has this many ranks; a larger value is corrupt or
hostile, and each distinct rank would otherwise become a source of its own (state that grows per payload)."""

_MALFORMED = (msgspec.DecodeError, UnicodeDecodeError, RecursionError)
"""What msgspec raises on bad input: ``DecodeError`` (``ValidationError`` is one: the wrong shape), but
also ``UnicodeDecodeError`` for a str that is not UTF-8 and ``RecursionError`` for nesting deeper than the
interpreter allows.  None of them may escape to the subscriber's loop."""


def _reason(e: BaseException, invalid: str) -> str:
    """The counted reason of a decode failure; ``invalid`` for well-formed msgpack of the wrong shape."""
    if isinstance(e, RecursionError):
        return "too_deep"
    if isinstance(e, msgspec.ValidationError) and invalid:
        return invalid
    return "msgpack"  # malformed msgpack, or a str that is not UTF-8


def _rank_ok(rank: int | None) -> bool:
    return rank is None or 0 <= rank <= MAX_DP_RANK


def stored_block_size(batch: DecodedBatch) -> int | None:
    """The block size a batch's stored blocks announce (the first real BlockStored; offload placeholders
    with no tokens say nothing), or None."""
    for ev in batch.events:
        if isinstance(ev, _StoredFields) and ev.block_size > 0 and not _empty(ev.token_ids):
            return ev.block_size
    return None


def offload_placeholders(batch: DecodedBatch) -> int:
    """BlockStored events of a tier below the GPU that carry no token ids: vLLM's OffloadingConnector
    announcing its CPU/storage copies without ``self_describing_kv_events``.  The index links them to the
    instance's GPU blocks by engine hash while those are known; copies that outlive the GPU copy are lost
    to routing."""
    return sum(
        1
        for ev in batch.events
        if isinstance(ev, _StoredFields) and _empty(ev.token_ids) and (ev.medium or "GPU").upper() != "GPU"
    )


def _empty(token_ids: msgspec.Raw) -> bool:
    raw = memoryview(token_ids)  # a Raw never equals bytes: compare its buffer
    return len(raw) == 1 and raw[0] == 0x90


def peek_ts(payload: bytes) -> float | None:
    """The batch timestamp of ``[float64 ts, ...]`` without decoding the rest (None for other shapes)."""
    if len(payload) >= 10 and payload[0] in (0x92, 0x93) and payload[1] == 0xCB:
        return float(_F64.unpack_from(payload, 2)[0])
    return None


def _peek_event_shape(payload: bytes) -> bool | None:
    """For ``[float64 ts, [event, ...], ...]``: True if events are maps, False if arrays, None otherwise."""
    if len(payload) < 12 or payload[0] not in (0x92, 0x93) or payload[1] != 0xCB:
        return None
    pos = 10
    b = payload[pos]
    if 0x91 <= b <= 0x9F:
        pos += 1
    elif b == 0xDC:
        pos += 3
    elif b == 0xDD:
        pos += 5
    else:
        return None
    if pos >= len(payload):
        return None
    e = payload[pos]
    if _is_map_header(e):
        return True
    if _is_array_header(e):
        return False
    return None


MASK64 = (1 << 64) - 1
_SIGN = 1 << 63


def engine_hash_u64(h: Hash) -> int:
    """Normalise a vLLM block hash: int -> h mod 2**64; bytes -> last 8 bytes, big-endian."""
    if isinstance(h, bytes):
        return int.from_bytes(h[-8:], "big")
    return h & MASK64


def engine_hash_i64(h: Hash) -> int:
    """The same hash as a signed 64-bit int, the form the index stores."""
    u = engine_hash_u64(h)
    return u - (1 << 64) if u & _SIGN else u
