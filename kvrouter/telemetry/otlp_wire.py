"""A traced request's phases written straight to OTLP protobuf bytes (``ExportTraceServiceRequest``).

::

    RequestRecord.compact() ──spans_of()──▶ bytes of Span messages
    [those bytes, ...] ──request()──▶ ResourceSpans ▸ ScopeSpans ▸ [Span ...]
    (both in the exporter's process, or on the export thread: never on the request path)

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

_F64 = struct.Struct("<Q").pack
_D64 = struct.Struct("<d").pack
_KIND = {"internal": b"\x30\x01", "server": b"\x30\x02", "client": b"\x30\x03"}
"""Span.kind (field 6): proto's SpanKind counts UNSPECIFIED as 0."""
_FLAGS_LOCAL = b"\x85\x01" + struct.pack("<I", 0x100)  # flags (16): the parent's remoteness is known: local
_FLAGS_REMOTE = b"\x85\x01" + struct.pack("<I", 0x300)  # ... and remote (the client's span)
_EMPTY_STATUS = b"\x7a\x00"  # status (15), unset
_SMALL = [bytes((i,)) for i in range(0x80)]
"""One-byte varints."""


def varint(n: int) -> bytes:
    if 0 <= n < 0x80:
        return bytes((n,))
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
        self._resource = field(0x0A, self.attributes(0x0A, resource))  # ResourceSpans.resource (1)
        self._scope = field(0x0A, field(0x0A, scope.encode()))  # ScopeSpans.scope (1) . name (1)

    def attributes(self, tag: int, attrs: Mapping[str, Any]) -> bytes:
        """Repeated KeyValue under field ``tag`` (the common scalar values written inline: this runs for
        every attribute of every traced request)."""
        keys, small = self._keys, _SMALL
        head = small[tag]
        out = []
        for k, v in attrs.items():
            kb = keys.get(k)
            if kb is None:
                kb = keys[k] = field(0x0A, k.encode())
            t = type(v)
            if t is str:
                b = v.encode()
                n = len(b)
                inner = b"\x0a" + small[n] + b if n < 0x80 else any_value(v)
            elif t is int:
                inner = b"\x18" + (small[v] if 0 <= v < 0x80 else varint(v))
            elif t is float:
                inner = b"\x21" + _D64(v)
            else:
                inner = any_value(v)
            n = len(inner)
            kv = kb + b"\x12" + small[n] + inner if n < 0x80 else kb + field(0x12, inner)
            n = len(kv)
            out.append(head + small[n] + kv if n < 0x80 else field(tag, kv))
        return b"".join(out)

    def spans(self, rec: RequestRecord) -> list[bytes]:
        """The request's spans: its root (child of the client's span, if any) and every phase."""
        return self.spans_of(rec.compact())

    def spans_of(self, c: Compact) -> list[bytes]:
        """``spans`` of a request's compact form (``RequestRecord.compact``), as the exporter gets it."""
        trace_id, tracestate, remote, spans = c
        head = b"\x0a\x10" + trace_id.to_bytes(16, "big")
        if tracestate:
            head += field(0x1A, tracestate.encode())
        names, kinds, attributes, small = self._names, _KIND, self.attributes, _SMALL
        out = []
        flags = _FLAGS_REMOTE if remote else _FLAGS_LOCAL
        for name, span_id, parent, kind, start, end, attrs in spans:
            nb = names.get(name)
            if nb is None:
                nb = names[name] = field(0x2A, name.encode())
            body = b"".join(
                (
                    head,
                    b"\x12\x08",
                    span_id.to_bytes(8, "big"),
                    b"" if parent is None else b"\x22\x08" + parent.to_bytes(8, "big"),
                    nb,
                    kinds[kind],
                    b"\x39",
                    _F64(start),
                    b"\x41",
                    _F64(end),
                    attributes(0x4A, attrs) if attrs else b"",
                    _EMPTY_STATUS,
                    flags,
                )
            )
            n = len(body)
            out.append(
                (b"\x12" + small[n] if n < 0x80 else b"\x12" + varint(n)) + body
            )  # ScopeSpans.spans (2)
            flags = _FLAGS_LOCAL  # only the root's parent is the client's
        return out

    def request(self, spans: list[bytes]) -> bytes:
        """``ExportTraceServiceRequest`` holding ``spans`` (one ResourceSpans, one ScopeSpans)."""
        scope_spans = field(0x12, self._scope + b"".join(spans))
        return field(0x0A, self._resource + scope_spans)
