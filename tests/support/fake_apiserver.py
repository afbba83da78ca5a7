"""A fake of the Kubernetes API server's list-and-watch for EndpointSlices (aiohttp, on 127.0.0.1), for
tests of discovery and for trying the router without a cluster.

::

    put / delete ──▶ RV += 1, object stamped, history += (RV, type, object) ──▶ every open watch
    GET  .../namespaces/{ns}/endpointslices?labelSelector=k=v&limit=N&continue=T        LIST, paged
    GET  ...?watch=1&resourceVersion=RV&allowWatchBookmarks=true&timeoutSeconds=S     WATCH, JSON lines
    compact(rv)     history up to rv forgotten: a watch from an older RV gets 410 (HTTP status, or an
                    ERROR event with a Status of code 410, as ``gone_as``), a continue token too
    bookmark()      a BOOKMARK carrying the current RV to each watch that allows them
    drop_watches()  every open watch connection cut mid-stream (no end of the chunked body)

What it keeps faithful: resourceVersions are one global counter, strings on the wire; a watch from RV
sends every matching change after RV, then live ones; a DELETED event carries the object's last state with
the deletion's RV; a LIST page set is a snapshot (later pages of a continue token show the state of the
first); timeoutSeconds ends a watch cleanly.  Watches with RV ``""``/``"0"`` start with synthetic ADDED
events.  Only equality label selectors are understood.  ``requests`` records every call for assertions.

The bytes follow real API servers' (tests/kvrouter/membership/fixtures/apiserver_responses.json, held to
them by test_apiserver_fixtures.py): continue tokens as the API server encodes them (unpadded base64url
of {"v", "rv", "start"}) with ``remainingItemCount``; a BOOKMARK's object is the EndpointSlice zero value
with only the version set; Status objects carry ``metadata``; 410 messages are the API server's.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import json
from typing import Any, Literal

import msgspec
from aiohttp import web

_PATH = "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
_DROP = object()
_encode = msgspec.json.encode

Obj = dict[str, Any]


class Request(msgspec.Struct):
    """One call the fake answered."""

    kind: Literal["list", "watch"]
    resource_version: str | None
    """The resourceVersion asked for (watch), or the continue token's snapshot (list page)."""
    params: dict[str, str]
    status: int


def make_slice(
    name: str,
    service: str,
    endpoints: list[tuple[str, str, bool]],
    *,
    ports: dict[str, int] | None = None,
    labels: dict[str, str] | None = None,
    namespace: str = "default",
    address_type: str = "IPv4",
) -> Obj:
    """An EndpointSlice as the controller writes it; ``endpoints`` are ``(pod, ip, ready)``."""
    ports = {"http": 8000, "kv-events": 5557, "kv-replay": 5558} if ports is None else ports
    return {
        "kind": "EndpointSlice",
        "apiVersion": "discovery.k8s.io/v1",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {
                **(labels or {}),
                "kubernetes.io/service-name": service,
                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
            },
        },
        "addressType": address_type,
        "endpoints": [
            {
                "addresses": [ip],
                "conditions": {"ready": ready, "serving": ready, "terminating": False},
                "targetRef": {"kind": "Pod", "name": pod, "namespace": namespace},
            }
            for pod, ip, ready in endpoints
        ]
        or None,
        "ports": [{"name": n, "port": p, "protocol": "TCP"} for n, p in ports.items()],
    }


def _status(code: int, reason: str, message: str, metadata: Obj | None = None) -> Obj:
    return {"kind": "Status", "apiVersion": "v1", "metadata": metadata or {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}  # fmt: skip


INCONSISTENT_CONTINUE = (
    "The provided continue parameter is too old to display a consistent list result. You can start a new "
    "list without the continue parameter, or use the continue token in this response to retrieve the "
    "remainder of the results. Continuing with the provided token results in an inconsistent list - objects "
    "that were created, modified, or deleted between the time the first chunk was returned and now may show "
    "up in the list."
)
"""The API server's message for an expired continue token (its etcd3 store's ``inconsistentContinue``)."""


def encode_continue(rv: int, start: str) -> str:
    """A continue token as the API server makes one: unpadded base64url of compact JSON, keys in this order;
    ``start`` is the key to resume from (the last name returned, then a NUL)."""
    raw = json.dumps({"v": "meta.k8s.io/v1", "rv": rv, "start": start}, separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_continue(token: str) -> tuple[int, str]:
    data = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
    return int(data["rv"]), str(data["start"])


def _matches(obj: Obj, namespace: str, selector: str) -> bool:
    meta = obj["metadata"]
    if meta.get("namespace") != namespace:
        return False
    labels = meta.get("labels") or {}
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key.strip()) != value.strip():
            return False
    return True


class FakeApiServer:
    def __init__(
        self,
        *,
        token: str | None = None,
        gone_as: Literal["status", "event"] = "event",
    ) -> None:
        """``token``: if set, requests must bear it (else 401).  ``gone_as``: how an expired watch RV is
        answered (the API server has done both)."""
        self.token = token
        self.gone_as = gone_as
        self.rv = 1
        self.compacted = 0
        """Watches from an RV below this get 410."""
        self.objects: dict[tuple[str, str], Obj] = {}
        self.history: list[tuple[int, str, Obj]] = []
        self.requests: list[Request] = []
        self._watches: list[tuple[str, str, bool, asyncio.Queue[Any]]] = []
        self._snapshots: dict[int, list[Obj]] = {}
        self._runner: web.AppRunner | None = None
        self.base_url = ""

    # ------------------------------------------------------------------ lifecycle
    async def start(self, port: int) -> str:
        app = web.Application()
        app.router.add_get(_PATH, self._handle)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.base_url = f"http://127.0.0.1:{port}"
        return self.base_url

    async def stop(self) -> None:
        self.drop_watches()
        if self._runner is not None:
            await self._runner.cleanup()

    # ------------------------------------------------------------------ the cluster changes
    def put(self, obj: Obj) -> str:
        """Create or update an object (ADDED / MODIFIED); returns its new resourceVersion."""
        obj = copy.deepcopy(obj)
        meta = obj["metadata"]
        key = (meta["namespace"], meta["name"])
        kind = "MODIFIED" if key in self.objects else "ADDED"
        self.rv += 1
        meta["resourceVersion"] = str(self.rv)
        self.objects[key] = obj
        self._record(kind, obj)
        return str(self.rv)

    def delete(self, name: str, namespace: str = "default") -> str:
        obj = copy.deepcopy(self.objects.pop((namespace, name)))
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self._record("DELETED", obj)
        return str(self.rv)

    def compact(self, rv: int | None = None) -> None:
        """Forget history up to ``rv`` (default: now), as etcd compaction does."""
        self.compacted = self.rv if rv is None else rv
        self.history = [h for h in self.history if h[0] > self.compacted]
        self._snapshots = {k: v for k, v in self._snapshots.items() if k >= self.compacted}

    def bookmark(self) -> None:
        obj = {"kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
               "metadata": {"resourceVersion": str(self.rv), "creationTimestamp": None},
               "addressType": "", "endpoints": None, "ports": None}  # fmt: skip
        ev = {"type": "BOOKMARK", "object": obj}
        for _, _, bookmarks, q in self._watches:
            if bookmarks:
                q.put_nowait(ev)

    def drop_watches(self) -> None:
        for *_, q in self._watches:
            q.put_nowait(_DROP)

    def expire_watches(self) -> None:
        """Tell every open watch its RV is too old (ERROR 410), as after a compaction the cache misses."""
        for *_, q in self._watches:
            msg = f"too old resource version: {self.compacted - 1} ({self.rv})"
            q.put_nowait({"type": "ERROR", "object": _status(410, "Expired", msg)})

    @property
    def open_watches(self) -> int:
        return len(self._watches)

    def _record(self, kind: str, obj: Obj) -> None:
        self.history.append((self.rv, kind, obj))
        for ns, sel, _, q in self._watches:
            if _matches(obj, ns, sel):
                q.put_nowait({"type": kind, "object": obj})

    # ------------------------------------------------------------------ HTTP
    async def _handle(self, request: web.Request) -> web.StreamResponse:
        q = request.query
        params = dict(q)
        watch = q.get("watch") in ("1", "true")
        if self.token and request.headers.get("Authorization") != f"Bearer {self.token}":
            self.requests.append(Request("watch" if watch else "list", q.get("resourceVersion"), params, 401))
            return web.json_response(_status(401, "Unauthorized", "Unauthorized"), status=401)
        ns = request.match_info["namespace"]
        sel = q.get("labelSelector", "")
        if watch:
            return await self._watch(request, ns, sel, params)
        return self._list(ns, sel, params)

    def _list(self, ns: str, sel: str, params: dict[str, str]) -> web.Response:
        limit = int(params.get("limit", "0") or 0)
        token = params.get("continue")
        if token:
            snap_rv, after = decode_continue(token)
            items = self._snapshots.get(snap_rv)
            if items is None:
                self.requests.append(Request("list", str(snap_rv), params, 410))
                again = {"continue": encode_continue(-1, after)}
                return web.json_response(_status(410, "Expired", INCONSISTENT_CONTINUE, again), status=410)
            start = next((i for i, o in enumerate(items) if o["metadata"]["name"] >= after), len(items))
        else:
            snap_rv, start = self.rv, 0
            keys = sorted(k for k, o in self.objects.items() if _matches(o, ns, sel))
            items = [self.objects[k] for k in keys]
            if limit:
                self._snapshots[snap_rv] = items
        end = start + limit if limit else len(items)
        meta: Obj = {"resourceVersion": str(snap_rv)}
        if end < len(items):
            meta["continue"] = encode_continue(snap_rv, items[end - 1]["metadata"]["name"] + "\x00")
            meta["remainingItemCount"] = len(items) - end
        self.requests.append(Request("list", str(snap_rv), params, 200))
        body = {"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1", "metadata": meta,
                "items": items[start:end]}  # fmt: skip
        return web.Response(body=_encode(body), content_type="application/json")

    async def _watch(
        self, request: web.Request, ns: str, sel: str, params: dict[str, str]
    ) -> web.StreamResponse:
        rv_s = params.get("resourceVersion", "")
        rv = int(rv_s) if rv_s not in ("", "0") else None
        if rv is not None and rv < self.compacted and self.gone_as == "status":
            self.requests.append(Request("watch", rv_s, params, 410))
            msg = f"too old resource version: {rv} ({self.compacted})"
            return web.json_response(_status(410, "Gone", msg), status=410)
        self.requests.append(Request("watch", rv_s, params, 200))
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        if rv is not None and rv < self.compacted:
            msg = f"too old resource version: {rv} ({self.compacted})"
            ev = {"type": "ERROR", "object": _status(410, "Expired", msg)}
            await resp.write(_encode(ev) + b"\n")
            await resp.write_eof()
            return resp
        queue: asyncio.Queue[Any] = asyncio.Queue()
        if rv is None:
            for o in sorted(self.objects.values(), key=lambda o: o["metadata"]["name"]):
                if _matches(o, ns, sel):
                    queue.put_nowait({"type": "ADDED", "object": o})
        else:
            for hrv, kind, o in self.history:
                if hrv > rv and _matches(o, ns, sel):
                    queue.put_nowait({"type": kind, "object": o})
        entry = (ns, sel, params.get("allowWatchBookmarks") == "true", queue)
        self._watches.append(entry)
        timeout = float(params.get("timeoutSeconds", "1800"))
        try:
            async with asyncio.timeout(timeout):
                while True:
                    ev = await queue.get()
                    if ev is _DROP:
                        if request.transport is not None:
                            request.transport.abort()  # cut mid-stream: the chunked body never ends
                        return resp
                    await resp.write(_encode(ev) + b"\n")
                    if ev["type"] == "ERROR":
                        break
        except TimeoutError:
            pass  # timeoutSeconds: the server ends the watch cleanly
        finally:
            self._watches.remove(entry)
        with contextlib.suppress(ConnectionResetError):
            await resp.write_eof()
        return resp
