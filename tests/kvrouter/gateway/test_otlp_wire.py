"""``telemetry.otlp_wire`` against opentelemetry-proto's own decoder: what the router writes is the
``ExportTraceServiceRequest`` a collector reads, field for field, for any attribute values."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from kvrouter.telemetry.otlp_wire import OtlpEncoder
from kvrouter.telemetry.record import RequestRecord
from tests.support.otlp import value

scalars = st.one_of(
    st.text(max_size=20),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False),
)
attrs = st.dictionaries(st.text(min_size=1, max_size=12), scalars, max_size=6)


@settings(max_examples=80, deadline=None)
@given(attrs, attrs, st.booleans(), st.integers(0, 2**31))
def test_spans_decode_as_written(a1: dict, a2: dict, with_parent: bool, seed: int) -> None:
    rng = random.Random(seed)
    parent = (rng.getrandbits(128) or 1, rng.getrandbits(64) or 1, True) if with_parent else None
    rec = RequestRecord(
        "/v1/chat/completions",
        traced=True,
        trace_id=parent[0] if parent else rng.getrandbits(128) or 1,
        root_id=rng.getrandbits(64) or 1,
        parent=parent,
        tracestate="vendor=a1" if parent else None,
        ids=rng.getrandbits,
    )
    ph = rec.phase("kvrouter.decision", rec.start_ns, rec.start_ns + 1000, dict(a1))
    rec.upstream_started("whole", "w0", 1)
    rec.upstream_ended(**{k: v for k, v in a2.items() if k.isidentifier()})
    rec.ended(200)
    enc = OtlpEncoder({"service.name": "kvrouter", "n": 3})
    msg = ExportTraceServiceRequest.FromString(enc.request(enc.spans(rec)))
    (rs,) = msg.resource_spans
    assert {a.key: value(a.value) for a in rs.resource.attributes} == {"service.name": "kvrouter", "n": 3}
    (ss,) = rs.scope_spans
    assert ss.scope.name == "kvrouter"
    got = {s.name: s for s in ss.spans}
    root, dec = got["kvrouter.request"], got["kvrouter.decision"]
    assert all(s.trace_id == rec.trace_id.to_bytes(16, "big") for s in ss.spans)
    assert root.parent_span_id == (parent[1].to_bytes(8, "big") if parent else b"")
    assert root.kind == 2 and dec.kind == 1 and got["kvrouter.upstream.whole"].kind == 3
    assert dec.parent_span_id == root.span_id == rec.root.span_id.to_bytes(8, "big")
    assert (dec.start_time_unix_nano, dec.end_time_unix_nano) == (ph.start_ns, ph.end_ns)
    assert root.trace_state == ("vendor=a1" if parent else "")
    assert {a.key: value(a.value) for a in dec.attributes} == a1
    assert root.flags & 0x300 == (0x300 if parent else 0x100)
