"""Real API-server responses (fixtures/apiserver_responses.json, each with its source) against discovery and
against the fake API server every other discovery test uses.

1. Discovery reads the real bytes: a list page's version and continue token, bookmarks of the real shape
   (the watched type's zero value: nulls where lists are, "" where strings are), a watch ERROR 410, an
   HTTP 410 for an expired continue token.
2. The fake reproduces them: the same envelope keys and JSON types, continue tokens encoded as the API
   server encodes them, the same Status objects and 410 messages.  A fake that drifts from the real server
   fails here, not in a cluster.
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from kvrouter.membership import DiscoveryConfig, KubeConnection
from kvrouter.membership.discovery import EndpointSliceDiscovery
from kvrouter.membership.endpointslices import EndpointSliceList
from kvrouter.membership.errors import ResourceExpired
from kvrouter.membership.kube import KubeClient
from tests.support.fake_apiserver import FakeApiServer, make_slice
from tests.support.net import free_port

FIXTURES = json.loads((Path(__file__).parent / "fixtures" / "apiserver_responses.json").read_text())[
    "responses"
]
PATH = "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices"


def shape(v: Any) -> Any:
    """Keys and JSON types, recursively (lists by their first element): what a decoder depends on."""
    if isinstance(v, dict):
        return {k: shape(x) for k, x in v.items()}
    if isinstance(v, list):
        return [shape(v[0])] if v else []
    return type(v).__name__


def token_fields(token: str) -> dict[str, Any]:
    assert "=" not in token and re.fullmatch(r"[A-Za-z0-9_-]+", token), "unpadded base64url"
    out: dict[str, Any] = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
    return out


def test_every_fixture_names_its_source() -> None:
    for name, f in FIXTURES.items():
        assert f["kind"] in ("recorded", "derived") and f["source"], name


# ------------------------------------------------------------------------------- 1. discovery reads them
@asynccontextmanager
async def discovery() -> AsyncIterator[tuple[EndpointSliceDiscovery, list[list[str]]]]:
    seen: list[list[str]] = []
    async with aiohttp.ClientSession() as session:
        d = EndpointSliceDiscovery(
            DiscoveryConfig(service="vllm"),
            KubeConnection("http://127.0.0.1:9", "default"),
            session,
            lambda insts: seen.append([i.name for i in insts]),
            rng=random.Random(0),
        )
        yield d, seen


def test_a_real_list_page_decodes_with_its_version_and_continue_token() -> None:
    body = FIXTURES["list_page_with_continue"]["body"]
    page = msgspec.json.decode(json.dumps(body).encode(), type=EndpointSliceList)
    assert page.metadata.resource_version == body["metadata"]["resourceVersion"]
    assert page.metadata.continue_ == body["metadata"]["continue"]  # passed back verbatim: opaque


@pytest.mark.parametrize("name", ["watch_bookmark_pod", "watch_bookmark_job", "watch_bookmark_endpointslice"])
async def test_real_bookmarks_move_the_version_and_nothing_else(name: str) -> None:
    line = FIXTURES[name]["line"].encode()
    rv = json.loads(line)["object"]["metadata"]["resourceVersion"]
    async with discovery() as (d, seen):
        d.cache.replace([], "1")
        d._on_line(line)
        assert d.cache.resource_version == rv and seen == [] and d.counters["events_BOOKMARK"] == 1


async def test_a_real_watch_error_410_means_relist() -> None:
    async with discovery() as (d, _):
        with pytest.raises(ResourceExpired):
            d._on_line(FIXTURES["watch_error_410"]["line"].encode())


async def test_a_real_expired_continue_answer_means_relist() -> None:
    f = FIXTURES["list_410_expired_continue"]
    api = await _serve_status(f["http_status"], f["body"])
    try:
        async with aiohttp.ClientSession() as session:
            client = KubeClient(KubeConnection(api[0], "default"), session)
            with pytest.raises(ResourceExpired, match="too old to display a consistent list"):
                await client.get(PATH, {"limit": "1", "continue": "x"})
    finally:
        await api[1].cleanup()


async def _serve_status(status: int, body: dict[str, Any]) -> tuple[str, Any]:
    from aiohttp import web

    async def handle(request: web.Request) -> web.Response:
        return web.json_response(body, status=status)

    app = web.Application()
    app.router.add_get(PATH, handle)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return f"http://127.0.0.1:{port}", runner


# ------------------------------------------------------------------------------- 2. the fake reproduces them
@asynccontextmanager
async def fake() -> AsyncIterator[tuple[FakeApiServer, aiohttp.ClientSession]]:
    api = FakeApiServer()
    await api.start(free_port())
    for i in range(3):
        api.put(make_slice(f"vllm-{i}", "vllm", [(f"pod-{i}", f"10.0.0.{i}", True)]))
    try:
        async with aiohttp.ClientSession() as s:
            yield api, s
    finally:
        await api.stop()


async def get_json(s: aiohttp.ClientSession, url: str, **params: str) -> tuple[int, Any]:
    async with s.get(url, params=params) as r:
        return r.status, await r.json(content_type=None)


async def watch_lines(s: aiohttp.ClientSession, url: str, n: int, **params: str) -> list[Any]:
    out: list[Any] = []
    async with s.get(url, params={"watch": "1", **params}) as r:
        async for line in r.content:
            if line.strip():
                out.append(json.loads(line))
            if len(out) == n:
                break
    return out


async def test_the_fakes_list_pages_are_shaped_as_the_real_ones() -> None:
    real = FIXTURES["list_page_with_continue"]["body"]
    real_token = token_fields(real["metadata"]["continue"])
    async with fake() as (api, s):
        st, page = await get_json(
            s, api.base_url + PATH, labelSelector="kubernetes.io/service-name=vllm", limit="2"
        )
        assert st == 200
        assert shape(page["metadata"]) == shape(real["metadata"])
        assert {k: shape(v) for k, v in page.items() if k != "items"} == {
            k: shape(v) for k, v in real.items() if k != "items"
        }
        tok = token_fields(page["metadata"]["continue"])
        assert list(tok) == list(real_token) and tok["v"] == real_token["v"]
        # as in the real token: rv is the list's version, start the last name returned then a NUL
        assert tok["rv"] == int(page["metadata"]["resourceVersion"])
        assert real_token["rv"] == int(real["metadata"]["resourceVersion"])
        assert tok["start"] == page["items"][-1]["metadata"]["name"] + "\x00"
        assert real_token["start"] == real["items"][-1]["metadata"]["name"] + "\x00"
        assert page["metadata"]["remainingItemCount"] == 1
        st, rest = await get_json(
            s, api.base_url + PATH, labelSelector="kubernetes.io/service-name=vllm", limit="2",
            **{"continue": page["metadata"]["continue"]},
        )  # fmt: skip
        assert st == 200 and [i["metadata"]["name"] for i in rest["items"]] == ["vllm-2"]
        assert "continue" not in rest["metadata"]


async def test_the_fakes_expired_continue_is_the_real_answer() -> None:
    real = FIXTURES["list_410_expired_continue"]
    async with fake() as (api, s):
        _, page = await get_json(s, api.base_url + PATH, limit="1")
        api.put(make_slice("vllm-9", "vllm", []))  # the list's version falls behind ...
        api.compact()  # ... and out of the history
        st, body = await get_json(
            s, api.base_url + PATH, limit="1", **{"continue": page["metadata"]["continue"]}
        )
        assert st == real["http_status"]
        assert shape(body) == shape(real["body"])
        assert {k: body[k] for k in ("kind", "status", "message", "reason", "code")} == {
            k: real["body"][k] for k in ("kind", "status", "message", "reason", "code")
        }
        assert (
            token_fields(body["metadata"]["continue"])["rv"]
            == -1
            == token_fields(real["body"]["metadata"]["continue"])["rv"]
        )


async def test_the_fakes_bookmarks_are_shaped_as_the_real_ones() -> None:
    derived = json.loads(FIXTURES["watch_bookmark_endpointslice"]["line"])
    recorded = json.loads(FIXTURES["watch_bookmark_pod"]["line"])
    async with fake() as (api, s):
        url = api.base_url + PATH
        task_lines = watch_lines(s, url, 1, resourceVersion=str(api.rv), allowWatchBookmarks="true")
        task = asyncio.create_task(task_lines)
        while api.open_watches == 0:
            await asyncio.sleep(0.01)
        api.bookmark()
        (line,) = await asyncio.wait_for(task, 10.0)
    assert shape(line) == shape(derived)
    assert line["object"]["addressType"] == "" and line["object"]["endpoints"] is None
    # the envelope and metadata of the recorded bookmark, whatever the type
    assert set(line) == set(recorded) and shape(line["object"]["metadata"]) == shape(
        recorded["object"]["metadata"]
    )


@pytest.mark.parametrize("gone_as", ["event", "status"])
async def test_the_fakes_watch_410_is_the_real_answer(gone_as: str) -> None:
    real = json.loads(FIXTURES["watch_error_410"]["line"])
    api = FakeApiServer(gone_as=gone_as)  # type: ignore[arg-type]
    await api.start(free_port())
    try:
        api.put(make_slice("vllm-0", "vllm", [("pod-0", "10.0.0.1", True)]))
        api.put(make_slice("vllm-0", "vllm", [("pod-0", "10.0.0.1", False)]))
        api.compact()
        async with aiohttp.ClientSession() as s:
            if gone_as == "event":
                (line,) = await watch_lines(s, api.base_url + PATH, 1, resourceVersion="1")
                status = line["object"]
                assert shape(line) == shape(real)
            else:
                code, status = await get_json(s, api.base_url + PATH, watch="1", resourceVersion="1")
                assert code == 410
        assert shape(status) == shape(real["object"])
        assert status["code"] == 410 and status["status"] == real["object"]["status"]
        pattern = r"too old resource version: \d+ \(\d+\)"
        assert re.fullmatch(pattern, status["message"]) and re.fullmatch(pattern, real["object"]["message"])
    finally:
        await api.stop()
