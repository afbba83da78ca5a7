"""Real API-server responses (fixtures/apiserver_responses.json, each with its source) against discovery and
against the fake API server every other discovery test uses.

1. Discovery reads the real bytes: each is served over HTTP on 127.0.0.1 by a server that answers only
   with them, and read through kvrouter's Kubernetes client (``KubeApi``, on lightkube) and its
   list-and-watch loop (``ListWatch``), as in a cluster: a list page's version and continue token (sent
   back verbatim), bookmarks of the real shape (the watched type's zero value: nulls where lists are, ""
   where strings are; a custom resource's holds its kind alone) on each kind discovery watches, a watch
   ERROR 410 (relist), an HTTP 410 for an expired continue token.
2. The fake reproduces them: the same envelope keys and JSON types, continue tokens encoded as the API
   server encodes them, the same Status objects and 410 messages, each kind's bookmark.  A fake that drifts
   from the real server fails here, not in a cluster.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import random
import re
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvrouter.membership import KubeApi, KubeConnection
from kvrouter.membership.errors import ResourceExpired
from kvrouter.membership.kube import EndpointSliceResource, InferencePoolResource, PodResource, R
from kvrouter.membership.listwatch import Backoff, ListWatch
from tests.support.fake_apiserver import FakeApiServer, make_pod, make_pool, make_slice
from tests.support.net import free_port
from tests.support.wait import until

FIXTURES = json.loads((Path(__file__).parent / "fixtures" / "apiserver_responses.json").read_text())[
    "responses"
]
PATH = "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices"
COLLECTIONS: dict[type[Any], tuple[str, str]] = {
    EndpointSliceResource: (PATH, "discovery.k8s.io/v1"),
    PodResource: ("/api/v1/namespaces/default/pods", "v1"),
    InferencePoolResource: (
        "/apis/inference.networking.k8s.io/v1/namespaces/default/inferencepools",
        "inference.networking.k8s.io/v1",
    ),
}
"""Each kind discovery watches: its collection's path and apiVersion."""
BOOKMARKS = {
    "EndpointSlice": "watch_bookmark_endpointslice",
    "Pod": "watch_bookmark_pod",
    "InferencePool": "watch_bookmark_inferencepool",
}
"""The bookmark of each kind discovery watches, as the API server sends it."""


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
Answer = tuple[int, bytes]


class Replay:
    """An API server that answers one collection with given bytes only.  A list is answered by
    ``lists(params)``; the n-th watch writes ``watches[n]``'s lines and ends (as at timeoutSeconds), and
    once they are used up a watch stays open with nothing to say.  ``Content-Type: application/json``,
    exactly, as the API server sends it.  ``requests`` records each call's query."""

    def __init__(
        self, path: str, lists: Callable[[Mapping[str, str]], Answer], watches: list[list[str]] | None = None
    ) -> None:
        self.path, self.lists, self.watches = path, lists, list(watches or [])
        self.requests: list[dict[str, str]] = []
        self._done = asyncio.Event()
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get(self.path, self._handle)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        return f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        self._done.set()  # open watches end, so cleanup need not wait for them
        if self._runner is not None:
            await self._runner.cleanup()

    def watch_versions(self) -> list[str | None]:
        return [q.get("resourceVersion") for q in self.requests if q.get("watch") == "true"]

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        q = dict(request.query)
        self.requests.append(q)
        if q.get("watch") != "true":
            status, body = self.lists(q)
            return web.Response(body=body, status=status, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        with contextlib.suppress(ConnectionResetError):  # the client may hang up first (on an error)
            if self.watches:
                for line in self.watches.pop(0):
                    await resp.write(line.encode() + b"\n")
            else:
                await self._done.wait()
            await resp.write_eof()
        return resp


@asynccontextmanager
async def replay(
    path: str, lists: Callable[[Mapping[str, str]], Answer], watches: list[list[str]] | None = None
) -> AsyncIterator[tuple[Replay, KubeApi]]:
    server = Replay(path, lists, watches)
    url = await server.start()
    kube = KubeApi(KubeConnection(url, "default"))
    try:
        yield server, kube
    finally:
        await kube.close()
        await server.stop()


def recorded_pods(q: Mapping[str, str]) -> Answer:
    """The recorded PodList page, then (asked with its continue token) the end of that list: no items
    here, the same version, no token."""
    page = FIXTURES["list_page_with_continue"]["body"]
    if "continue" not in q:
        return 200, json.dumps(page).encode()
    end = {"kind": page["kind"], "apiVersion": page["apiVersion"],
           "metadata": {"resourceVersion": page["metadata"]["resourceVersion"]}, "items": []}  # fmt: skip
    return 200, json.dumps(end).encode()


def empty_list(res: type[Any], rv: str = "1") -> Callable[[Mapping[str, str]], Answer]:
    kind = res.__name__.removesuffix("Resource")
    body = {"kind": f"{kind}List", "apiVersion": COLLECTIONS[res][1], "metadata": {"resourceVersion": rv},
            "items": []}  # fmt: skip
    return lambda q: (200, json.dumps(body).encode())


def list_watch(kube: KubeApi, res: type[R], changes: list[int]) -> ListWatch[R]:
    return ListWatch(
        kube, res, lambda: changes.append(1), backoff=Backoff(0.01, 0.05, random.Random(0)), name="fixtures"
    )


async def test_a_real_list_page_is_read_with_its_version_and_continue_token() -> None:
    body = FIXTURES["list_page_with_continue"]["body"]
    async with replay(COLLECTIONS[PodResource][0], recorded_pods) as (server, kube):
        items, rv = await asyncio.wait_for(kube.list(PodResource, page_size=1), 15.0)
    assert rv == body["metadata"]["resourceVersion"]
    assert [(p.metadata.name, p.metadata.namespace, p.metadata.labels) for p in items] == [
        (i["metadata"]["name"], i["metadata"]["namespace"], i["metadata"]["labels"]) for i in body["items"]
    ]
    assert [q.get("limit") for q in server.requests] == ["1", "1"]
    assert "continue" not in server.requests[0]
    assert server.requests[1]["continue"] == body["metadata"]["continue"]  # passed back verbatim: opaque


RECORDED_BOOKMARKS = [f"watch_bookmark_{k}" for k in ("endpointslice", "inferencepool", "job", "pod")]
"""Every bookmark the fixture file holds, by name: one that disappears fails the run instead of leaving
the parametrization below without a case."""


def test_the_bookmarks_are_the_recorded_ones() -> None:
    assert sorted(n for n in FIXTURES if n.startswith("watch_bookmark_")) == RECORDED_BOOKMARKS


@pytest.mark.parametrize("res", list(COLLECTIONS), ids=lambda r: r.__name__)
@pytest.mark.parametrize("name", RECORDED_BOOKMARKS)
async def test_real_bookmarks_move_the_version_and_nothing_else(name: str, res: type[Any]) -> None:
    """Every recorded or derived bookmark, on a watch of each kind discovery reads: whatever kind's zero
    value the object holds (nulls where our types have lists, a spec with fields we do not know, no spec
    at all), only its version is taken, and the next watch resumes from it."""
    line = FIXTURES[name]["line"]
    rv = json.loads(line)["object"]["metadata"]["resourceVersion"]
    changes: list[int] = []
    async with replay(COLLECTIONS[res][0], empty_list(res), [[line]]) as (server, kube):
        lw = list_watch(kube, res, changes)
        lw.start()
        try:
            await until(lambda: len(server.watch_versions()) == 2, what="the watch resumed")
        finally:
            await lw.stop()
    assert server.watch_versions() == ["1", rv]
    assert lw.cache.resource_version == rv and lw.cache.objects == {}
    assert lw.counters["events_BOOKMARK"] == 1 and changes == [1]  # the list's on_change, none since
    assert not [k for k in lw.counters if k.startswith("errors_")]


async def test_a_recorded_pod_bookmark_keeps_the_listed_pods() -> None:
    """The recorded pages, then the recorded Pod bookmark on the pod watch: the listed pod stays."""
    line = FIXTURES["watch_bookmark_pod"]["line"]
    changes: list[int] = []
    async with replay(COLLECTIONS[PodResource][0], recorded_pods, [[line]]) as (server, kube):
        lw = list_watch(kube, PodResource, changes)
        lw.start()
        try:
            await until(lambda: len(server.watch_versions()) == 2, what="the watch resumed")
        finally:
            await lw.stop()
    listed = FIXTURES["list_page_with_continue"]["body"]
    assert server.watch_versions() == [listed["metadata"]["resourceVersion"], "3845"]
    assert list(lw.cache.objects) == [i["metadata"]["name"] for i in listed["items"]]
    assert lw.cache.resource_version == "3845" and changes == [1]


async def test_a_real_watch_error_410_means_relist() -> None:
    line = FIXTURES["watch_error_410"]["line"]
    status = json.loads(line)["object"]
    async with replay(COLLECTIONS[PodResource][0], recorded_pods, [[line]]) as (_, kube):
        with pytest.raises(ResourceExpired, match=re.escape(status["message"])) as e:
            async for _ in kube.watch(PodResource, resource_version="1"):
                pass
        assert e.value.event  # an ERROR event, not an HTTP status
    changes: list[int] = []
    async with replay(COLLECTIONS[PodResource][0], recorded_pods, [[line]]) as (server, kube):
        lw = list_watch(kube, PodResource, changes)
        lw.start()
        try:
            await until(lambda: len(server.watch_versions()) == 2, what="the watch after the relist")
        finally:
            await lw.stop()
    assert lw.counters["gone"] == 1 and lw.counters["events_ERROR"] == 1
    assert lw.counters["lists"] == 1 and lw.counters["relists"] == 1 and changes == [1, 1]
    # the relist started again without a continue token: two pages each time
    assert ["continue" in q for q in server.requests if q.get("watch") != "true"] == [False, True] * 2
    assert not [k for k in lw.counters if k.startswith("errors_")]


async def test_a_real_expired_continue_answer_means_relist() -> None:
    f = FIXTURES["list_410_expired_continue"]

    def expired_after_the_first_page(q: Mapping[str, str]) -> Answer:
        if "continue" in q:
            return f["http_status"], json.dumps(f["body"]).encode()
        return recorded_pods(q)

    async with replay(COLLECTIONS[PodResource][0], expired_after_the_first_page) as (server, kube):
        with pytest.raises(ResourceExpired, match="too old to display a consistent list") as e:
            await asyncio.wait_for(kube.list(PodResource, page_size=1), 15.0)
    assert not e.value.event  # an HTTP 410, not a watch event
    first = FIXTURES["list_page_with_continue"]["body"]["metadata"]["continue"]
    assert [q.get("continue") for q in server.requests] == [None, first]


# ------------------------------------------------------------------------------- 2. the fake reproduces them
@asynccontextmanager
async def fake() -> AsyncIterator[tuple[FakeApiServer, aiohttp.ClientSession]]:
    """Three objects of each kind."""
    api = FakeApiServer()
    await api.start(free_port())
    for i in range(3):
        api.put(make_slice(f"vllm-{i}", "vllm", [(f"pod-{i}", f"10.0.0.{i}", True)]))
        api.put(make_pod(f"pod-{i}", f"10.0.0.{i}", labels={"app": "vllm"}))
        api.put(make_pool(f"vllm-{i}", {"app": "vllm"}, [8000]))
    try:
        async with aiohttp.ClientSession() as s:
            yield api, s
    finally:
        await api.stop()


async def get_json(s: aiohttp.ClientSession, url: str, **params: str) -> tuple[int, Any]:
    async with s.get(url, params=params) as r:
        # the API server's JSON serializer's media type, no charset: lightkube reads an error's Status
        # only under exactly this type
        assert r.headers["Content-Type"] == "application/json"
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


@pytest.mark.parametrize("res", list(COLLECTIONS), ids=lambda r: r.__name__)
async def test_the_fakes_list_pages_are_shaped_as_the_real_ones(res: type[Any]) -> None:
    real = FIXTURES["list_page_with_continue"]["body"]
    real_token = token_fields(real["metadata"]["continue"])
    path, api_version = COLLECTIONS[res]
    async with fake() as (api, s):
        st, page = await get_json(s, api.base_url + path, limit="2")
        assert st == 200
        assert shape(page["metadata"]) == shape(real["metadata"])
        assert {k: shape(v) for k, v in page.items() if k != "items"} == {
            k: shape(v) for k, v in real.items() if k != "items"
        }
        assert page["kind"] == res.__name__.removesuffix("Resource") + "List"
        assert page["apiVersion"] == api_version
        if res is PodResource:  # the recorded page is a PodList
            assert (page["kind"], page["apiVersion"]) == (real["kind"], real["apiVersion"])
        tok = token_fields(page["metadata"]["continue"])
        assert list(tok) == list(real_token) and tok["v"] == real_token["v"]
        # as in the real token: rv is the list's version, start the last name returned then a NUL
        assert tok["rv"] == int(page["metadata"]["resourceVersion"])
        assert real_token["rv"] == int(real["metadata"]["resourceVersion"])
        assert tok["start"] == page["items"][-1]["metadata"]["name"] + "\x00"
        assert real_token["start"] == real["items"][-1]["metadata"]["name"] + "\x00"
        assert page["metadata"]["remainingItemCount"] == 1
        st, rest = await get_json(
            s, api.base_url + path, limit="2", **{"continue": page["metadata"]["continue"]}
        )
        assert st == 200 and [i["metadata"]["name"] for i in rest["items"]] == [
            ("pod-2" if res is PodResource else "vllm-2")
        ]
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


@pytest.mark.parametrize("res", list(COLLECTIONS), ids=lambda r: r.__name__)
async def test_the_fakes_bookmarks_are_shaped_as_the_real_ones(res: type[Any]) -> None:
    kind = res.__name__.removesuffix("Resource")
    real = json.loads(FIXTURES[BOOKMARKS[kind]]["line"])
    recorded = json.loads(FIXTURES["watch_bookmark_pod"]["line"])
    async with fake() as (api, s):
        url = api.base_url + COLLECTIONS[res][0]
        task_lines = watch_lines(s, url, 1, resourceVersion=str(api.rv), allowWatchBookmarks="true")
        task = asyncio.create_task(task_lines)
        await until(lambda: api.open_watches == 1, what="the watch opened")
        api.bookmark()
        (line,) = await asyncio.wait_for(task, 10.0)
    assert shape(line) == shape(real)  # the kind's own zero value, as the API server serializes it
    assert (line["object"]["kind"], line["object"]["apiVersion"]) == (kind, COLLECTIONS[res][1])
    assert line["object"]["metadata"]["resourceVersion"] == str(api.rv)
    # the envelope of the recorded bookmark, whatever the type
    assert set(line) == set(recorded)


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
