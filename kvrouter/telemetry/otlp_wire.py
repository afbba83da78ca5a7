"""A traced request's phases written straight to OTLP protobuf bytes (``ExportTraceServiceRequest``).

::

    RequestRecord.compact() ──spans_of()──▶ bytes of Span messages     (as the request ends: SpanSink.emit)
    [those bytes, ...] ──request()──▶ ResourceSpans ▸ ScopeSpans ▸ [Span ...]   (the exporter's process)

The SDK's encoder builds a protobuf object per span, attribute and value (and the SDK a ``Span`` with its
locks and limits before that); writing the bytes directly costs a fraction of it, which is what keeps a
sampled request within its CPU budget (figures: docs/measurements.md).  Messages and field numbers are
opentelemetry-proto's (``trace/v1/trace.proto``, ``common/v1/common.proto``); the tests decode the output
with opentelemetry-proto's own classes.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

from .record import Compact, RequestRecord

_ID = struct.Struct(">HQ").pack
"""span_id (2, 8 bytes): tag and length, then the id (big-endian, as in its hex form)."""
_IDS = struct.Struct(">HQHQ").pack
"""span_id (2) and parent_span_id (4)."""
_TIMES = struct.Struct("<BQBQ").pack
"""start_time_unix_nano (7) and end_time_unix_nano (8), fixed64."""
_D64 = struct.Struct("<d").pack
_KIND = {"internal": b"\x30\x01", "server": b"\x30\x02", "client": b"\x30\x03"}
"""Span.kind (field 6): proto's SpanKind counts UNSPECIFIED as 0."""
_FLAGS_LOCAL = b"\x85\x01" + struct.pack("<I", 0x100)  # flags (16): the parent's remoteness is known: local
_FLAGS_REMOTE = b"\x85\x01" + struct.pack("<I", 0x300)  # ... and remote (the client's span)
_EMPTY_STATUS = b"\x7a\x00"  # status (15), unset
_TAIL_LOCAL = _EMPTY_STATUS + _FLAGS_LOCAL
_TAIL_REMOTE = _EMPTY_STATUS + _FLAGS_REMOTE
KV_CACHE = 4096
"""Encoded span attributes kept at most (``OtlpEncoder.span_attributes``)."""


def varint(n: int) -> bytes:
    if 0 <= n < 0x80:
        return bytes((n,))
    if 0 < n < 0x4000:
        return bytes(((n & 0x7F) | 0x80, n >> 7))
    if n < 0:
        n &= (1 << 64) - 1  # int64 as protobuf writes it: ten bytes, two's complement
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def field(tag: int, payload: bytes) -> bytes:
    """A length-delimited field (``tag``: field number << 3 | 2)."""
    n = len(payload)
    return (bytes((tag, n)) if n < 0x80 and tag < 0x80 else varint(tag) + varint(n)) + payload


def any_value(v: Any) -> bytes:
    """AnyValue: string 1, bool 2, int 3, double 4, array 5."""
    if isinstance(v, str):
        return field(0x0A, v.encode())
    if isinstance(v, bool):
        return b"\x10\x01" if v else b"\x10\x00"
    if isinstance(v, int):
        return b"\x18" + varint(v)
    if isinstance(v, float):
        return b"\x21" + _D64(v)
    if isinstance(v, list | tuple):
        return field(0x2A, b"".join(field(0x0A, any_value(x)) for x in v))
    return field(0x0A, str(v).encode())


class OtlpEncoder:
    """Writes spans for one resource and instrumentation scope; keeps each attribute key's bytes."""

    def __init__(self, resource: Mapping[str, Any], scope: str = "kvrouter") -> None:
        self._keys: dict[str, bytes] = {}
        self._names: dict[str, bytes] = {}
        self._kv: dict[tuple[str, str | int], bytes] = {}
        self._resource = field(0x0A, self.attributes(0x0A, resource))  # ResourceSpans.resource (1)
        self._scope = field(0x0A, field(0x0A, scope.encode()))  # ScopeSpans.scope (1) . name (1)

    def attributes(self, tag: int, attrs: Mapping[str, Any]) -> bytes:
        """Repeated KeyValue under field ``tag``."""
        return b"".join(self._entry(tag, k, v) for k, v in attrs.items())

    def _entry(self, tag: int, k: str, v: Any) -> bytes:
        """One KeyValue as field ``tag`` of its message."""
        kb = self._keys.get(k)
        if kb is None:
            kb = self._keys[k] = field(0x0A, k.encode())
        t = type(v)
        if t is str:
            inner = field(0x0A, v.encode())
        elif t is int:
            inner = b"\x18" + varint(v)
        elif t is float:
            inner = b"\x21" + _D64(v)
        else:
            inner = any_value(v)
        return field(tag, kb + field(0x12, inner))

    def span_attributes(self, attrs: Mapping[str, Any]) -> bytes:
        """Span.attributes (9): each (key, value) written once and kept.  Most repeat (a policy, a
        target, a tier's name, small counts), so the entry is a dict lookup; only exact ``str`` and
        ``int`` values are kept (``1``, ``True`` and ``1.0`` are equal as dict keys, and are not one
        AnyValue), the cache emptied once it holds ``KV_CACHE`` entries (token counts and byte sizes
        vary per request)."""
        cache, entry = self._kv, self._entry
        out = []
        for k, v in attrs.items():
            t = type(v)
            if t is str or t is int:
                kv = cache.get((k, v))
                if kv is None:
                    if len(cache) >= KV_CACHE:
                        cache.clear()
                    kv = cache[(k, v)] = entry(0x4A, k, v)
                out.append(kv)
            else:
                out.append(entry(0x4A, k, v))
        return b"".join(out)

    def spans(self, rec: RequestRecord) -> list[bytes]:
        """The request's spans: its root (child of the client's span, if any) and every phase."""
        return self.spans_of(rec.compact())

    def spans_of(self, c: Compact) -> list[bytes]:
        """``spans`` of a request's compact form (``RequestRecord.compact``), as the exporter gets it."""
        trace_id, tracestate, remote, spans = c
        head = b"\x0a\x10" + trace_id
        if tracestate:
            head += field(0x1A, tracestate.encode())
        names, kinds, span_attrs = self._names, _KIND, self.span_attributes
        out = []
        tail = _TAIL_REMOTE if remote else _TAIL_LOCAL
        for name, span_id, parent, kind, start, end, attrs in spans:
            nb = names.get(name)
            if nb is None:
                nb = names[name] = field(0x2A, name.encode())
            body = b"".join(
                (
                    head,
                    _ID(0x1208, span_id) if parent is None else _IDS(0x1208, span_id, 0x2208, parent),
                    nb,
                    kinds[kind],
                    _TIMES(0x39, start, 0x41, end),
                    span_attrs(attrs) if attrs else b"",
                    tail,
                )
            )
            n = len(body)
            out.append(  # ScopeSpans.spans (2)
                (b"\x12" + bytes(((n & 0x7F) | 0x80, n >> 7)) if 0x80 <= n < 0x4000 else b"\x12" + varint(n))
                + body
            )
            tail = _TAIL_LOCAL  # only the root's parent is the client's
        return out

    def request(self, spans: list[bytes]) -> bytes:
        """``ExportTraceServiceRequest`` holding ``spans`` (one ResourceSpans, one ScopeSpans)."""
        scope_spans = field(0x12, self._scope + b"".join(spans))
        return field(0x0A, self._resource + scope_spans)
