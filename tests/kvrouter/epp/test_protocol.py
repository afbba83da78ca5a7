"""The Endpoint Picker Protocol's messages, read and written (pure)."""

from __future__ import annotations

from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, Metadata
from google.protobuf.struct_pb2 import Struct
from hypothesis import given
from hypothesis import strategies as st

from indexer.config import InstanceConfig
from kvrouter.epp import protocol
from kvrouter.epp.endpoints import EndpointMap
from kvrouter.routing import Candidate
from kvrouter.types import InstanceId, TargetKey


@given(st.binary(max_size=2000), st.integers(1, 300))
def test_chunks_cover_the_body_in_order_within_the_limit(body: bytes, limit: int) -> None:
    got = list(protocol.chunks(body, limit))
    assert b"".join(p for p, _ in got) == body
    assert all(len(p) <= limit for p, _ in got)
    assert [eos for _, eos in got] == [False] * (len(got) - 1) + [True]
    assert all(p for p, _ in got) or body == b""


def test_endpoint_of_url() -> None:
    assert protocol.endpoint_of_url("http://10.0.0.1:8000/") == "10.0.0.1:8000"
    assert protocol.endpoint_of_url("https://vllm-0") == "vllm-0:443"
    assert protocol.endpoint_of_url("http://[fd00::1]:8000") == "[fd00::1]:8000"
    assert protocol.endpoint_of_url(None) is None and protocol.endpoint_of_url("nonsense") is None


def _md(namespace: str, key: str, value: object) -> Metadata:
    s = Struct()
    s.update({key: value})
    md = Metadata()
    md.filter_metadata[namespace].CopyFrom(s)
    return md


def test_subset_as_list_or_comma_string_and_absent() -> None:
    assert protocol.subset_of(
        _md(protocol.SUBSET_NAMESPACE, protocol.SUBSET_KEY, ["1.1.1.1:80", "2.2.2.2:80"])
    ) == [
        "1.1.1.1:80",
        "2.2.2.2:80",
    ]
    assert protocol.subset_of(
        _md(protocol.SUBSET_NAMESPACE, protocol.SUBSET_KEY, "1.1.1.1:80, 2.2.2.2:80")
    ) == [
        "1.1.1.1:80",
        "2.2.2.2:80",
    ]
    assert protocol.subset_of(_md(protocol.SUBSET_NAMESPACE, protocol.SUBSET_KEY, [])) == []  # none allowed
    assert protocol.subset_of(Metadata()) is None
    assert protocol.subset_of(_md(protocol.SUBSET_NAMESPACE, "other", "1.1.1.1:80")) is None
    md = Metadata()
    assert protocol.served_of(md) is None and len(md.filter_metadata) == 0  # reading inserts nothing
    assert protocol.served_of(_md(protocol.LB_NAMESPACE, protocol.SERVED_KEY, "3.3.3.3:80")) == "3.3.3.3:80"


def test_header_map_reads_raw_values_and_keeps_the_first() -> None:
    h = HeaderMap(
        headers=[
            HeaderValue(key=":path", raw_value=b"/v1/completions"),
            HeaderValue(key="Authorization", value="Bearer k"),
            HeaderValue(key="authorization", raw_value=b"Bearer other"),
        ]
    )
    assert protocol.header_map(h) == {":path": "/v1/completions", "authorization": "Bearer k"}


def test_routed_names_the_same_endpoints_in_header_and_metadata() -> None:
    body = b"x" * 150
    out = protocol.routed(
        [protocol.Endpoint("1.1.1.1:80"), protocol.Endpoint("2.2.2.2:80")], body, {"x-a": "b"}, limit=64
    )
    head = out[0].request_headers.response
    headers = {o.header.key: o.header.raw_value.decode() for o in head.header_mutation.set_headers}
    assert headers[protocol.ENDPOINT_HEADER] == "1.1.1.1:80,2.2.2.2:80"
    assert headers["content-length"] == "150" and headers["x-a"] == "b"
    assert head.clear_route_cache
    lb = out[0].dynamic_metadata.fields[protocol.LB_NAMESPACE].struct_value.fields
    assert lb[protocol.ENDPOINT_HEADER].string_value == headers[protocol.ENDPOINT_HEADER]
    pieces = [m.request_body.response.body_mutation.streamed_response for m in out[1:]]
    assert b"".join(p.body for p in pieces) == body and [p.end_of_stream for p in pieces] == [
        False,
        False,
        True,
    ]


def test_immediate_response() -> None:
    m = protocol.immediate(429, b'{"error": {}}', {"retry-after": "1"}).immediate_response
    assert m.status.code == 429 and m.body == b'{"error": {}}'
    assert {o.header.key for o in m.headers.set_headers} == {"content-type", "retry-after"}


def _cand(name: str, rank: int = 0, saturated: bool = False) -> Candidate:
    key = TargetKey(name if rank == 0 else f"{name}/{rank}")
    return Candidate(InstanceId(name), rank, key, saturated=saturated)


def test_fallback_list_one_per_endpoint_same_rank_not_saturated() -> None:
    emap = EndpointMap(
        [
            InstanceConfig("a", "http://10.0.0.1:8000"),
            InstanceConfig("b", "http://10.0.0.2:8000", dp_size=2),
            InstanceConfig("c", "http://10.0.0.3:8000"),
            InstanceConfig("d", "http://10.0.0.4:8000"),
        ]
    )
    ranked = [_cand("a"), _cand("b", 0), _cand("b", 1), _cand("c", saturated=True), _cand("d")]
    assert [c.target for c in emap.ordered(ranked[0], ranked, 3)] == ["a", "b", "d"]
    assert [c.target for c in emap.ordered(ranked[0], ranked, 1)] == ["a"]
    assert [c.target for c in emap.ordered(ranked[2], ranked, 4)] == ["b/1"]  # rank 1 exists only on b
    assert emap.targets([protocol.Endpoint("10.0.0.2:8000"), protocol.Endpoint("9.9.9.9:1")]) == {
        "b/0",
        "b/1",
    }
