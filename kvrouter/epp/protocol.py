"""The Endpoint Picker Protocol's wire, read and written (pure: protobuf messages in and out, no I/O).

::

    Envoy ──ProcessingRequest──▶ picker                          picker ──ProcessingResponse──▶ Envoy
      request_headers   (:method :path, authorization ...)        headers: x-gateway-destination-endpoint
      request_body      chunks until end_of_stream                         (+ envoy.lb dynamic metadata,
      metadata_context  envoy.lb.subset_hint: the candidates               the same value), clear_route_cache
      response_headers  :status; envoy.lb ...-served: who served   body:    streamed_response chunks
      response_body     chunks (SSE or one JSON body)                       of at most BODY_CHUNK bytes
                                                                   or an immediate response (429, 503 ...)

An endpoint is ``ip:port`` (``[v6]:port``), as the Gateway API Inference Extension writes it.  A list of
endpoints is written comma-separated, best first: the gateway tries them in order.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import NewType
from urllib.parse import urlsplit

from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, HeaderValueOption, Metadata
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    BodyMutation,
    BodyResponse,
    CommonResponse,
    HeaderMutation,
    HeadersResponse,
    ImmediateResponse,
    ProcessingResponse,
    StreamedBodyResponse,
    TrailersResponse,
)
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.struct_pb2 import Struct, Value

Endpoint = NewType("Endpoint", str)
"""``ip:port`` of a model server, as the gateway routes to it."""

ENDPOINT_HEADER = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
"""Where the choice goes in the dynamic metadata, and where the served endpoint comes back."""
SERVED_KEY = "x-gateway-destination-endpoint-served"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
BODY_CHUNK = 62_000
"""Largest body mutation sent back: Envoy caps a streamed body message near 64 KiB."""

SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"
"""The ext_proc service, also a health-check service name (with ``liveness`` and ``readiness``)."""


# ---------------------------------------------------------------------------------------------- reading
def header_map(h: HeaderMap) -> dict[str, str]:
    """Header names lower-cased (HTTP/2 and Envoy already send them so) and values as text.  Envoy sends a
    value as ``raw_value`` bytes (or ``value`` from older releases); a repeated header keeps its first."""
    out: dict[str, str] = {}
    for hv in h.headers:
        name = hv.key.lower()
        if name not in out:
            out[name] = hv.raw_value.decode("utf-8", "replace") if hv.raw_value else hv.value
    return out


def endpoint_of_url(url: str | None) -> Endpoint | None:
    """``http://10.0.0.1:8000/`` -> ``10.0.0.1:8000`` (the scheme's port when none is written)."""
    if not url:
        return None
    u = urlsplit(url)
    if not u.hostname:
        return None
    port = u.port or (443 if u.scheme == "https" else 80)
    host = f"[{u.hostname}]" if ":" in u.hostname else u.hostname
    return Endpoint(f"{host}:{port}")


def parse_endpoints(value: str) -> list[Endpoint]:
    """``a:1, b:2`` -> ``[a:1, b:2]`` (blanks dropped, order kept)."""
    return [Endpoint(p.strip()) for p in value.split(",") if p.strip()]


def _strings(v: Value) -> list[str]:
    kind = v.WhichOneof("kind")
    if kind == "string_value":
        return [v.string_value]
    if kind == "list_value":
        return [s for item in v.list_value.values for s in _strings(item)]
    return []


def _lookup(md: Metadata, namespace: str, key: str) -> Value | None:
    # .get, never [...]: indexing a protobuf message map inserts the missing key.
    ns = md.filter_metadata.get(namespace)
    return None if ns is None else ns.fields.get(key)


def subset_of(md: Metadata) -> list[Endpoint] | None:
    """The candidates the gateway allows (a list of ``ip:port`` or one comma-separated string); None when
    it sent no hint (every endpoint of the pool is a candidate).  An empty list allows none."""
    v = _lookup(md, SUBSET_NAMESPACE, SUBSET_KEY)
    if v is None:
        return None
    return [e for s in _strings(v) for e in parse_endpoints(s)]


def served_of(md: Metadata) -> Endpoint | None:
    """The endpoint that served the request, as the gateway reports it on the response path."""
    v = _lookup(md, LB_NAMESPACE, SERVED_KEY)
    got = [e for s in _strings(v) for e in parse_endpoints(s)] if v is not None else []
    return got[0] if got else None


# ---------------------------------------------------------------------------------------------- writing
def _mutation(set_headers: Mapping[str, str], remove: Iterable[str] = ()) -> HeaderMutation:
    return HeaderMutation(
        set_headers=[
            HeaderValueOption(
                header=HeaderValue(key=k, raw_value=v.encode()),
                append_action=HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
            )
            for k, v in set_headers.items()
        ],
        remove_headers=list(remove),
    )


def chunks(body: bytes, limit: int = BODY_CHUNK) -> Iterator[tuple[bytes, bool]]:
    """``(piece, end_of_stream)`` of at most ``limit`` bytes each; an empty body is one empty last piece."""
    if not body:
        yield b"", True
        return
    for i in range(0, len(body), limit):
        yield body[i : i + limit], i + limit >= len(body)


def body_response(piece: bytes, end_of_stream: bool, *, request: bool) -> ProcessingResponse:
    """One streamed body mutation (FULL_DUPLEX_STREAMED: the body Envoy forwards is what we send back)."""
    br = BodyResponse(
        response=CommonResponse(
            body_mutation=BodyMutation(
                streamed_response=StreamedBodyResponse(body=piece, end_of_stream=end_of_stream)
            )
        )
    )
    return ProcessingResponse(request_body=br) if request else ProcessingResponse(response_body=br)


def routed(
    endpoints: list[Endpoint],
    body: bytes,
    extra_headers: Mapping[str, str] | None = None,
    *,
    limit: int = BODY_CHUNK,
) -> list[ProcessingResponse]:
    """The answer to a request whose body has ended: the destination (header and ``envoy.lb`` metadata, one
    value: the endpoints best first), the route cache cleared so the new header routes, then the body
    (perhaps rewritten) in streamed pieces, the last one ending the stream."""
    assert endpoints, "a routed answer names at least one endpoint"
    value = ",".join(endpoints)
    headers = {ENDPOINT_HEADER: value, "content-length": str(len(body)), **(extra_headers or {})}
    md = Struct()
    md.get_or_create_struct(LB_NAMESPACE)[ENDPOINT_HEADER] = value
    first = ProcessingResponse(
        request_headers=HeadersResponse(
            response=CommonResponse(header_mutation=_mutation(headers), clear_route_cache=True)
        ),
        dynamic_metadata=md,
    )
    return [first, *(body_response(p, eos, request=True) for p, eos in chunks(body, limit))]


def bodyless_routed(
    endpoints: list[Endpoint], extra_headers: Mapping[str, str] | None = None
) -> ProcessingResponse:
    """The answer to a request without a body (its headers ended the stream): the destination alone."""
    value = ",".join(endpoints)
    md = Struct()
    md.get_or_create_struct(LB_NAMESPACE)[ENDPOINT_HEADER] = value
    headers = {ENDPOINT_HEADER: value, **(extra_headers or {})}
    return ProcessingResponse(
        request_headers=HeadersResponse(
            response=CommonResponse(header_mutation=_mutation(headers), clear_route_cache=True)
        ),
        dynamic_metadata=md,
    )


def immediate(status: int, body: bytes, headers: Mapping[str, str] | None = None) -> ProcessingResponse:
    """Answer the client now, without an upstream (429 shed, 503 no endpoint, 4xx the client's mistake)."""
    h = {"content-type": "application/json", **(headers or {})}
    return ProcessingResponse(
        immediate_response=ImmediateResponse(
            status=HttpStatus(code=status), headers=_mutation(h), body=body, details=f"kvrouter_{status}"
        )
    )


def response_headers(
    set_headers: Mapping[str, str] | None = None, remove: Iterable[str] = ()
) -> ProcessingResponse:
    """Let the response headers through (with ours added, and the gateway's internal ones removed)."""
    return ProcessingResponse(
        response_headers=HeadersResponse(
            response=CommonResponse(header_mutation=_mutation(set_headers or {}, remove))
        )
    )


def trailers(*, request: bool) -> ProcessingResponse:
    """Let trailers through unchanged."""
    t = TrailersResponse()
    return ProcessingResponse(request_trailers=t) if request else ProcessingResponse(response_trailers=t)
