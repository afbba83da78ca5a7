"""The two front doors serve one table (``api.routes``): the aiohttp gateway and the endpoint picker read
every routed path as the same kind, leave every other path to their own rule (the gateway passes it
through, the picker refuses a body it cannot read), and guard the same admin paths with the admin token.

Both run over the same simulated fleet; what each door hands the request pipeline is read off the real
pipeline's ``prepare`` (a recording wrapper that calls it unchanged)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import grpc
import msgspec
import pytest
import pytest_asyncio
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    HttpHeaders,
    ProcessingRequest,
    ProcessingResponse,
)

from kvrouter.api.requests import Kind
from kvrouter.api.routes import ADMIN_PATHS, ROUTED
from kvrouter.epp import PickerOptions
from kvrouter.pipeline import RequestPipeline
from tests.support.envoy import picker
from tests.support.gateway import MODEL, gateway, sim_fleet
from tests.support.net import free_port

pytestmark = pytest.mark.asyncio(loop_scope="module")

TOKEN = "t0ken"
BODY = msgspec.json.encode(
    {
        "model": MODEL,
        "prompt": "hello",
        "messages": [{"role": "user", "content": "hello"}],
        "input": "hello",
        "max_tokens": 1,
    }
)
NOT_ROUTED = ("/tokenize", "/v1/embed", "/v3/rerank", "/v1/chat")


@dataclass
class Doors:
    base: str
    """The gateway's URL."""
    channel: grpc.aio.Channel
    """The picker's ext_proc service."""
    gateway_kinds: list[Kind | None]
    picker_kinds: list[Kind | None]


def recording(pipeline: RequestPipeline) -> list[Kind | None]:
    """The kind of every request the front door prepares, in order."""
    seen: list[Kind | None] = []
    prepare = pipeline.prepare

    async def recorded(raw, kind, headers, **kw):  # type: ignore[no-untyped-def]
        seen.append(kind)
        return await prepare(raw, kind, headers, **kw)

    pipeline.prepare = recorded  # type: ignore[method-assign]
    return seen


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def doors() -> AsyncIterator[Doors]:
    guarded = {"gateway": {"admin_token": TOKEN}}
    async with (
        sim_fleet(2) as fleet,
        gateway(fleet, **guarded) as (gw, base),
        picker(fleet, options=PickerOptions(grpc_port=free_port()), **guarded) as (pk, server),
        grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        yield Doors(base, channel, recording(gw.pipeline), recording(pk.pipeline))


async def through_picker(
    channel: grpc.aio.Channel, path: str, authorization: str | None = None
) -> ProcessingResponse:
    """A POST with a body through the picker: its answer to the body (or to the headers, if it refused
    them)."""
    call = ext_proc_grpc.ExternalProcessorStub(channel).Process()
    hv = [HeaderValue(key=":method", raw_value=b"POST"), HeaderValue(key=":path", raw_value=path.encode())]
    if authorization is not None:
        hv.append(HeaderValue(key="authorization", raw_value=authorization.encode()))
    await call.write(ProcessingRequest(request_headers=HttpHeaders(headers=HeaderMap(headers=hv))))
    await call.write(ProcessingRequest(request_body=HttpBody(body=BODY, end_of_stream=True)))
    first = await call.read()
    call.cancel()
    assert isinstance(first, ProcessingResponse)
    return first


async def through_gateway(base: str, path: str, authorization: str | None = None) -> int:
    headers = {"Authorization": authorization} if authorization is not None else {}
    async with aiohttp.ClientSession() as s, s.post(f"{base}{path}", data=BODY, headers=headers) as r:
        return r.status


@pytest.mark.parametrize("path", sorted(ROUTED))
async def test_both_doors_read_a_routed_path_as_its_kind(doors: Doors, path: str) -> None:
    del doors.gateway_kinds[:], doors.picker_kinds[:]
    await through_gateway(doors.base, path)
    answer = await through_picker(doors.channel, path)
    assert not answer.HasField("immediate_response") or answer.immediate_response.status.code != 404
    assert doors.gateway_kinds == doors.picker_kinds == [ROUTED[path]]


@pytest.mark.parametrize("path", NOT_ROUTED)
async def test_a_path_outside_the_table_is_routed_by_neither(doors: Doors, path: str) -> None:
    del doors.gateway_kinds[:], doors.picker_kinds[:]
    await through_gateway(doors.base, path)
    answer = await through_picker(doors.channel, path)
    assert answer.immediate_response.status.code == 404
    assert doors.gateway_kinds == ["other"]  # passed through by model and load
    assert doors.picker_kinds == []


@pytest.mark.parametrize("path", sorted(ADMIN_PATHS))
async def test_both_doors_guard_the_admin_paths(doors: Doors, path: str) -> None:
    for authorization in (None, "Bearer wrong"):
        assert await through_gateway(doors.base, path, authorization) == 401
        answer = await through_picker(doors.channel, path, authorization)
        assert answer.immediate_response.status.code == 401
    assert await through_gateway(doors.base, path, f"Bearer {TOKEN}") != 401
    answer = await through_picker(doors.channel, path, f"Bearer {TOKEN}")
    assert not answer.HasField("immediate_response") or answer.immediate_response.status.code != 401


async def test_a_routed_path_needs_no_admin_token(doors: Doors) -> None:
    assert not ADMIN_PATHS & set(ROUTED)
    answer = await through_picker(doors.channel, "/v1/completions")
    assert not answer.HasField("immediate_response")
