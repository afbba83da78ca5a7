"""The encoder's kept attributes (``OtlpEncoder.span_attributes``): values equal as dict keys but not one
AnyValue (``1``, ``True``, ``1.0``) stay apart, an entry written from the cache is the one written
afresh, and the cache's bound empties it without changing the output.  Decoded with
opentelemetry-proto's own classes."""

from __future__ import annotations

from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from kvrouter.telemetry import otlp_wire
from kvrouter.telemetry.otlp_wire import OtlpEncoder


def plain(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [plain(x) for x in v.array_value.values]
    return (kind, getattr(v, kind))


_KINDS = {bool: "bool_value", int: "int_value", float: "double_value", str: "string_value"}


def expected(v: Any) -> Any:
    return [expected(x) for x in v] if isinstance(v, list) else (_KINDS[type(v)], v)


def request(enc: OtlpEncoder, spans: list[tuple[int, dict[str, Any]]]) -> bytes:
    c = ((7).to_bytes(16, "big"), None, False, [("s", i, None, "internal", 1, 2, a) for i, a in spans])
    return enc.request(enc.spans_of(c))


def decode(enc: OtlpEncoder, spans: list[tuple[int, dict[str, Any]]]) -> list[dict[str, Any]]:
    got = ExportTraceServiceRequest.FromString(request(enc, spans)).resource_spans[0].scope_spans[0].spans
    assert [s.span_id for s in got] == [i.to_bytes(8, "big") for i, _ in spans]
    return [{kv.key: plain(kv.value) for kv in s.attributes} for s in got]


def test_kept_attributes_are_what_a_fresh_encoding_writes(monkeypatch: Any) -> None:
    values: list[Any] = [1, True, 1.0, "1", 0, False, -3, 200, 1 << 40, "x" * 300, "", [1, "a"], 0.25]
    spans = [(i + 1, {"k": v, "n": i % 3}) for i, v in enumerate(values * 3)]  # each value thrice
    want = [{"k": expected(a["k"]), "n": expected(a["n"])} for _, a in spans]
    assert decode(OtlpEncoder({}), spans) == want
    enc = OtlpEncoder({})
    first = request(enc, spans)
    assert request(enc, spans) == first  # all from the cache now
    monkeypatch.setattr(otlp_wire, "KV_CACHE", 4)  # emptied every few entries: the same bytes
    small = OtlpEncoder({})
    assert decode(small, spans) == want
    assert request(small, spans) == first and len(small._kv) <= 4
