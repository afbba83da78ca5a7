"""The picker's gRPC service driven message by message, as a gateway would (a real grpc client over
127.0.0.1, a simulated fleet): candidate subsets, fallbacks served, streams that end early, requests
without a body, bad bodies, and the health services."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import msgspec
import pytest
import pytest_asyncio
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, Metadata
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    HttpHeaders,
    ProcessingRequest,
    ProcessingResponse,
)
from google.protobuf.struct_pb2 import Struct
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvrouter.epp import Picker, PickerOptions, protocol
from kvrouter.lab.sim.server.fleet import SimFleet
from tests.support.envoy import picker
from tests.support.gateway import MODEL, sim_fleet
from tests.support.net import free_port
from tests.support.wait import until

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rig() -> AsyncIterator[tuple[SimFleet, Picker, grpc.aio.Channel]]:
    opts = PickerOptions(grpc_port=free_port(), fallbacks=3)
    async with (
        sim_fleet(3) as fleet,
        picker(fleet, options=opts, flows={"objectives": {"premium": 5}}) as (pk, server),
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch,
    ):
        yield fleet, pk, ch


def headers(
    path: str, *, eos: bool = False, method: str = "POST", extra: dict[str, str] | None = None
) -> ProcessingRequest:
    hm = HeaderMap(
        headers=[
            HeaderValue(key=":method", raw_value=method.encode()),
            HeaderValue(key=":path", raw_value=path.encode()),
            HeaderValue(key="content-type", raw_value=b"application/json"),
            *(HeaderValue(key=k, raw_value=v.encode()) for k, v in (extra or {}).items()),
        ]
    )
    return ProcessingRequest(request_headers=HttpHeaders(headers=hm, end_of_stream=eos))


def body(data: bytes, md: Metadata | None = None) -> ProcessingRequest:
    return ProcessingRequest(
        request_body=HttpBody(body=data, end_of_stream=True), metadata_context=md or Metadata()
    )


def subset_md(value: object) -> Metadata:
    s = Struct()
    s.update({protocol.SUBSET_KEY: value})
    md = Metadata()
    md.filter_metadata[protocol.SUBSET_NAMESPACE].CopyFrom(s)
    return md


def response_headers(status: int, served: str | None, eos: bool = False) -> ProcessingRequest:
    md = Metadata()
    if served is not None:
        s = Struct()
        s.update({protocol.SERVED_KEY: served})
        md.filter_metadata[protocol.LB_NAMESPACE].CopyFrom(s)
    hm = HeaderMap(headers=[HeaderValue(key=":status", raw_value=str(status).encode())])
    return ProcessingRequest(response_headers=HttpHeaders(headers=hm, end_of_stream=eos), metadata_context=md)


class Stream:
    """One ext_proc stream: send a message, read the answers it gets."""

    def __init__(self, ch: grpc.aio.Channel) -> None:
        self.call = ext_proc_grpc.ExternalProcessorStub(ch).Process()

    async def send(self, msg: ProcessingRequest, answers: int) -> list[ProcessingResponse]:
        await self.call.write(msg)
        return [await self.call.read() for _ in range(answers)]

    async def close(self) -> None:
        await self.call.done_writing()


def destination(resp: ProcessingResponse) -> list[str]:
    m = resp.request_headers.response.header_mutation
    value = next(
        o.header.raw_value.decode() for o in m.set_headers if o.header.key == protocol.ENDPOINT_HEADER
    )
    return protocol.parse_endpoints(value)


def prompt(words: int = 40) -> bytes:
    return msgspec.json.encode({"model": MODEL, "prompt": "lorem ipsum " * words, "max_tokens": 2})


def in_flight(pk: Picker, target: str) -> int:
    load = pk.gw.router.load.loads.get(target)  # type: ignore[call-overload]
    return 0 if load is None else load.effective_in_flight()


async def test_the_candidate_subset_is_obeyed(rig: tuple[SimFleet, Picker, grpc.aio.Channel]) -> None:
    fleet, _, ch = rig
    eps = [protocol.endpoint_of_url(u) for u in fleet.urls]
    for allowed in ([eps[2]], f"{eps[1]}, 9.9.9.9:1"):
        s = Stream(ch)
        await s.send(headers("/v1/completions"), 0)
        out = await s.send(body(prompt(), subset_md(allowed)), 2)
        dest = destination(out[0])
        assert dest[0] == (eps[2] if isinstance(allowed, list) else eps[1]) and len(dest) == 1
        await s.close()
    for none_fits in ([], ["9.9.9.9:1"]):
        s = Stream(ch)
        await s.send(headers("/v1/completions"), 0)
        (out,) = await s.send(body(prompt(), subset_md(none_fits)), 1)
        assert out.immediate_response.status.code == 503
        await s.close()


async def test_a_fallback_served_carries_the_load_and_the_usage(
    rig: tuple[SimFleet, Picker, grpc.aio.Channel],
) -> None:
    _, pk, ch = rig
    s = Stream(ch)
    await s.send(headers("/v1/completions"), 0)
    out = await s.send(body(prompt(60)), 2)
    first, second = destination(out[0])[:2]
    name = {protocol.endpoint_of_url(u.cfg.url): n for n, u in pk.pool.upstreams.items()}
    assert in_flight(pk, name[first]) == 1
    before = pk.metrics.fallbacks.labels(name[second])._value.get()
    await s.send(response_headers(200, second), 1)
    assert in_flight(pk, name[first]) == 0 and in_flight(pk, name[second]) == 1
    assert pk.metrics.fallbacks.labels(name[second])._value.get() == before + 1
    answer = b'{"usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 7}}}'
    reported = pk.gw.metrics.pipeline.reported_cached.labels(name[second])._value.get()
    (echo,) = await s.send(ProcessingRequest(response_body=HttpBody(body=answer, end_of_stream=True)), 1)
    assert echo.response_body.response.body_mutation.streamed_response.body == answer  # passed back as is
    assert in_flight(pk, name[second]) == 0
    assert pk.gw.metrics.pipeline.reported_cached.labels(name[second])._value.get() == reported + 7
    await s.close()


async def test_a_stream_that_ends_early_releases_its_load(
    rig: tuple[SimFleet, Picker, grpc.aio.Channel],
) -> None:
    _, pk, ch = rig
    s = Stream(ch)
    await s.send(headers("/v1/chat/completions"), 0)
    msg = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    out = await s.send(body(msgspec.json.encode(msg)), 2)
    name = {protocol.endpoint_of_url(u.cfg.url): n for n, u in pk.pool.upstreams.items()}[
        destination(out[0])[0]
    ]
    assert in_flight(pk, name) == 1
    s.call.cancel()  # the client went away before any answer
    await until(lambda: in_flight(pk, name) == 0, what="load released")


async def test_a_streamed_answer_teaches_the_latency_models_both_times(
    rig: tuple[SimFleet, Picker, grpc.aio.Channel],
) -> None:
    """The picker sees the first chunk (TTFT) and the stream's usage block (its output tokens, so TPOT):
    the same observations as ``serve``'s proxy, learned by the same book."""
    _, pk, ch = rig
    book = pk.gw.router.latency

    def trained() -> dict[str, int]:
        return {k: book.outcomes[(k, "used")] + book.outcomes[(k, "clipped")] for k in ("ttft", "tpot")}

    before = trained()
    s = Stream(ch)
    await s.send(headers("/v1/completions"), 0)
    req = {"model": MODEL, "prompt": "lorem ipsum " * 30, "max_tokens": 5, "stream": True}
    req["stream_options"] = {"include_usage": True}
    out = await s.send(body(msgspec.json.encode(req)), 2)
    await s.send(response_headers(200, destination(out[0])[0]), 1)
    await s.send(ProcessingRequest(response_body=HttpBody(body=b'data: {"choices": [{"text": "a"}]}\n\n')), 1)
    await asyncio.sleep(0.05)  # the later tokens' pace: > 0
    usage = {"prompt_tokens": 61, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 0}}
    last = b"data: " + msgspec.json.encode({"choices": [], "usage": usage}) + b"\n\ndata: [DONE]\n\n"
    await s.send(ProcessingRequest(response_body=HttpBody(body=last, end_of_stream=True)), 1)
    await s.close()

    want = {k: n + 1 for k, n in before.items()}
    await until(lambda: trained() == want, what="one TTFT and one TPOT observation trained")


async def test_bodyless_and_bad_requests(rig: tuple[SimFleet, Picker, grpc.aio.Channel]) -> None:
    _, _, ch = rig
    s = Stream(ch)
    (out,) = await s.send(headers("/v1/models", eos=True, method="GET"), 1)
    assert len(destination(out)) >= 1
    await s.close()
    s = Stream(ch)
    await s.send(headers("/v1/completions"), 0)
    (out,) = await s.send(body(b"{not json"), 1)
    assert out.immediate_response.status.code == 400
    await s.close()
    s = Stream(ch)
    (out,) = await s.send(headers("/v1/no-such-route"), 1)
    assert out.immediate_response.status.code == 404
    await s.close()


async def test_stored_responses_are_read_where_they_were_made(
    rig: tuple[SimFleet, Picker, grpc.aio.Channel],
) -> None:
    """A Responses answer's id, read off the response path, pins a later GET (or cancel) of it to the
    instance that served it; an id no instance holds is vLLM's 404."""
    _, _, ch = rig
    s = Stream(ch)
    await s.send(headers("/v1/responses"), 0)
    out = await s.send(body(msgspec.json.encode({"model": MODEL, "input": "remember this"})), 2)
    served = destination(out[0])[0]
    await s.send(response_headers(200, served), 1)
    use = b'"usage":{"input_tokens":5,"input_tokens_details":{"cached_tokens":0}}'
    answer = b'{"id":"resp_epp1","object":"response",' + use + b"}"
    await s.send(ProcessingRequest(response_body=HttpBody(body=answer, end_of_stream=True)), 1)
    await s.close()
    for path in ("/v1/responses/resp_epp1", "/v1/responses/resp_epp1/cancel"):
        s = Stream(ch)
        (out,) = await s.send(headers(path, eos=True, method="GET" if "cancel" not in path else "POST"), 1)
        assert destination(out)[0] == served
        await s.close()
    s = Stream(ch)
    (out,) = await s.send(headers("/v1/responses/resp_nowhere", eos=True, method="GET"), 1)
    assert out.immediate_response.status.code == 404
    await s.close()


async def test_health_services(rig: tuple[SimFleet, Picker, grpc.aio.Channel]) -> None:
    _, _, ch = rig
    stub = health_pb2_grpc.HealthStub(ch)
    for service in ("liveness", "readiness", protocol.SERVICE_NAME):
        r = await stub.Check(health_pb2.HealthCheckRequest(service=service))
        assert r.status == health_pb2.HealthCheckResponse.SERVING, service


async def test_a_tenant_key_reaches_the_pipeline_through_the_picker(
    rig: tuple[SimFleet, Picker, grpc.aio.Channel],
) -> None:
    """Envoy sends header names in lower case: a listed key is accepted (the tenant's salt applied) and an
    unknown one refused, exactly as through the gateway."""
    fleet = rig[0]
    tenants = {"require_api_key": True, "api_keys": {"key-a": {"name": "a", "salt": "salt-a"}}}
    async with (
        picker(fleet, tenants=tenants) as (_, server),
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch,
    ):
        for key, want in (("key-a", None), ("key-b", 401), (None, 401)):
            extra = [HeaderValue(key="authorization", raw_value=f"Bearer {key}".encode())] if key else []
            msg = headers("/v1/completions")
            msg.request_headers.headers.headers.extend(extra)
            s = Stream(ch)
            await s.send(msg, 0)
            (out,) = await s.send(body(prompt()), 1)
            if want is None:
                assert not out.HasField("immediate_response"), out
                assert destination(out)
                await s.call.read()  # the body's own answer
            else:
                assert out.immediate_response.status.code == want, out
            await s.close()


async def test_the_inference_objective_names_the_priority(
    rig: tuple[SimFleet, Picker, grpc.aio.Channel],
) -> None:
    _, pk, ch = rig
    admitted = pk.gw.pipeline.metrics.flows.admitted
    before = admitted.labels("default", "5")._value.get()
    s = Stream(ch)
    await s.send(headers("/v1/completions", extra={"x-gateway-inference-objective": "premium"}), 0)
    out = await s.send(body(prompt()), 2)
    assert destination(out[0])
    await s.close()
    assert admitted.labels("default", "5")._value.get() == before + 1
    warnings = pk.gw.pipeline.metrics.flows.header_warnings
    s = Stream(ch)
    await s.send(headers("/v1/completions", extra={"x-gateway-inference-objective": "nope"}), 0)
    out = await s.send(body(prompt()), 2)
    assert destination(out[0])
    await s.close()
    assert warnings.labels("objective", "unknown")._value.get() == 1
