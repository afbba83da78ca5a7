"""A fake of the Kubernetes API server's list-and-watch for EndpointSlices, Pods and InferencePools
(aiohttp, on 127.0.0.1), for tests of discovery and for trying the router without a cluster.

::

    put / delete ──▶ RV += 1, object stamped, history += (RV, type, object) ──▶ every open watch
    GET  .../namespaces/{ns}/endpointslices?labelSelector=k=v&limit=N&continue=T        LIST, paged
         (also /api/v1/.../pods and /apis/inference.networking.k8s.io/v1/.../inferencepools)
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

Several kinds (added for Pods and InferencePools): an object is keyed by its kind, namespace and name, and
a collection lists and watches its own kind only; the resourceVersion counter stays one for all, as etcd's
revision is.  A field selector of ``metadata.name`` / ``metadata.namespace`` equalities is understood.  A
watch with a selector sees an object *enter* it as ADDED and *leave* it as DELETED (the previous state with
the change's version), as the API server's watch cache filters updates; a delete, bookmark or compaction
acts as before.

The bytes follow real API servers' (tests/kvrouter/membership/fixtures/apiserver_responses.json, held to
them by test_apiserver_fixtures.py): continue tokens as the API server encodes them (unpadded base64url
of {"v", "rv", "start"}) with ``remainingItemCount``; a BOOKMARK's object is the watched kind's zero value
with only the version set; Status objects carry ``metadata``; 410 messages are the API server's.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import functools
import json
from typing import Any, Literal

import msgspec
from aiohttp import web

_PATH = "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
_DROP = object()
_encode = msgspec.json.encode

Obj = dict[str, Any]

_TRUE = ("1", "t", "T", "true", "True", "TRUE")
"""What the API server reads as true in a query (Go's strconv.ParseBool): ``watch=True`` is a watch."""
_PATHS = {
    "EndpointSlice": _PATH,
    "Pod": "/api/v1/namespaces/{namespace}/pods",
    "InferencePool": "/apis/inference.networking.k8s.io/v1/namespaces/{namespace}/inferencepools",
}
"""Each kind's collection (all namespaced)."""
_API_VERSION = {
    "EndpointSlice": "discovery.k8s.io/v1",
    "Pod": "v1",
    "InferencePool": "inference.networking.k8s.io/v1",
}
_ZERO: dict[str, Obj] = {
    "EndpointSlice": {"addressType": "", "endpoints": None, "ports": None},
    "Pod": {"spec": {"containers": None}, "status": {}},
    "InferencePool": {},
}
"""What a BOOKMARK's object holds besides kind, apiVersion and metadata: the kind's zero value, as the API
server sends it.  Built-in kinds serialize their Go struct (fields without omitempty as "", null, {});
a custom resource (InferencePool) is served unstructured, and its zero value is the kind alone."""
_ZERO_META: dict[str, Obj] = {
    "EndpointSlice": {"creationTimestamp": None},
    "Pod": {"creationTimestamp": None},
    "InferencePool": {},
}
"""A BOOKMARK's metadata besides resourceVersion: a built-in kind's ObjectMeta serializes its zero
creationTimestamp as null; an unstructured one holds only what was set."""


class Request(msgspec.Struct):
    """One call the fake answered."""

    kind: Literal["list", "watch"]
    resource_version: str | None
    """The resourceVersion asked for (watch), or the continue token's snapshot (list page)."""
    params: dict[str, str]
    status: int
    resource: str = "EndpointSlice"
    """The kind whose collection was asked."""


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


def make_pod(
    name: str,
    ip: str | None,
    *,
    ready: bool = True,
    labels: dict[str, str] | None = None,
    ports: dict[str, int] | None = None,
    annotations: dict[str, str] | None = None,
    namespace: str = "default",
    deleting: bool = False,
) -> Obj:
    """A Pod as the kubelet reports it: ``ip`` None while it is being scheduled (no ``podIP`` yet), the
    ``Ready`` condition as ``ready``; ``ports`` are the container's named ports."""
    ports = {"http": 8000, "kv-events": 5557, "kv-replay": 5558} if ports is None else ports
    meta: Obj = {"name": name, "namespace": namespace, "labels": dict(labels or {})}
    if annotations:
        meta["annotations"] = dict(annotations)
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status: Obj = {
        "phase": "Running" if ip else "Pending",
        "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": "True" if ready else "False"},
            {"type": "ContainersReady", "status": "True" if ready else "False"},
        ],
    }
    if ip:
        status["podIP"] = ip
        status["podIPs"] = [{"ip": ip}]
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": meta,
        "spec": {
            "containers": [
                {
                    "name": "vllm",
                    "image": "vllm/vllm-openai",
                    "ports": [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in ports.items()],
                }
            ]
        },
        "status": status,
    }


def make_pool(
    name: str,
    selector: dict[str, str],
    ports: list[int],
    *,
    namespace: str = "default",
    picker: str = "kvrouter-epp",
) -> Obj:
    """An InferencePool (``inference.networking.k8s.io/v1``) with its picker's Service on port 9002."""
    return {
        "kind": "InferencePool",
        "apiVersion": "inference.networking.k8s.io/v1",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "selector": {"matchLabels": dict(selector)},
            "targetPorts": [{"number": n} for n in ports],
            "appProtocol": "http",
            "endpointPickerRef": {
                "group": "",
                "kind": "Service",
                "name": picker,
                "port": {"number": 9002},
                "failureMode": "FailClose",
            },
        },
    }


def _status(code: int, reason: str, message: str, metadata: Obj | None = None) -> Obj:
    return {"kind": "Status", "apiVersion": "v1", "metadata": metadata or {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}  # fmt: skip


def _answer(obj: Obj, status: int = 200) -> web.Response:
    """A JSON answer as the API server sends it: ``Content-Type: application/json`` exactly, no charset
    (a client may read the Status of an error only under that type: lightkube does)."""
    return web.Response(body=_encode(obj), status=status, content_type="application/json")


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


def _fields_match(obj: Obj, fields: str) -> bool:
    """A field selector of ``metadata.name=x`` / ``metadata.namespace=y`` terms (``=`` or ``==``)."""
    meta = obj["metadata"]
    for term in filter(None, fields.split(",")):
        key, _, value = term.partition("=")
        field = key.strip().removeprefix("metadata.")
        if meta.get(field) != value.strip().lstrip("="):
            return False
    return True


class _Watch:
    """One open watch: what it selects, and its queue of events to write."""

    def __init__(self, kind: str, ns: str, sel: str, fields: str, bookmarks: bool) -> None:
        self.kind, self.ns, self.sel, self.fields, self.bookmarks = kind, ns, sel, fields, bookmarks
        self.queue: asyncio.Queue[Any] = asyncio.Queue()

    def selects(self, obj: Obj | None) -> bool:
        return (
            obj is not None
            and obj.get("kind", "EndpointSlice") == self.kind
            and _matches(obj, self.ns, self.sel)
            and _fields_match(obj, self.fields)
        )


async def _version(request: web.Request) -> web.Response:
    """``GET /version``, which some clients (kr8s) ask before anything else."""
    return web.json_response(
        {"major": "1", "minor": "33", "gitVersion": "v1.33.0", "platform": "linux/amd64"}
    )


def _event_for(w: _Watch, etype: str, obj: Obj, prev: Obj | None) -> Obj | None:
    """The event watch ``w`` sees for one change, or None.  An update that moves an object into the
    selection is ADDED; out of it, DELETED with the previous state at the change's version."""
    now = w.selects(obj)
    if etype != "MODIFIED":
        return {"type": etype, "object": obj} if now else None
    before = w.selects(prev)
    if now:
        return {"type": "MODIFIED" if before else "ADDED", "object": obj}
    if before and prev is not None:
        gone = copy.deepcopy(prev)
        gone["metadata"]["resourceVersion"] = obj["metadata"]["resourceVersion"]
        return {"type": "DELETED", "object": gone}
    return None


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
        self.objects: dict[tuple[str, str, str], Obj] = {}
        """By kind, namespace and name."""
        self.history: list[tuple[int, str, Obj, Obj | None]] = []
        """(RV, type, object, its previous state for a MODIFIED)."""
        self.requests: list[Request] = []
        self._watches: list[_Watch] = []
        self._snapshots: dict[tuple[str, str, str, str, int], list[Obj]] = {}
        """A paged list's items by (kind, namespace, label and field selectors, RV): a continue request
        names the same collection and selectors as its first page."""
        self._runner: web.AppRunner | None = None
        self.base_url = ""

    # ------------------------------------------------------------------ lifecycle
    async def start(self, port: int) -> str:
        app = web.Application()
        for kind, path in _PATHS.items():
            app.router.add_get(path, functools.partial(self._handle, kind=kind))
        app.router.add_get("/version", _version)
        app.router.add_get("/version/", _version)
        # a client hanging up ends its watch at once, as on the API server (whose request context ends):
        # without this, aiohttp leaves the handler waiting for the next event of a watch nobody reads
        self._runner = web.AppRunner(app, handle_signals=False, handler_cancellation=True)
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
        key = (obj.get("kind", "EndpointSlice"), meta["namespace"], meta["name"])
        prev = self.objects.get(key)
        kind = "MODIFIED" if prev is not None else "ADDED"
        self.rv += 1
        meta["resourceVersion"] = str(self.rv)
        self.objects[key] = obj
        self._record(kind, obj, prev)
        return str(self.rv)

    def delete(self, name: str, namespace: str = "default", *, kind: str = "EndpointSlice") -> str:
        obj = copy.deepcopy(self.objects.pop((kind, namespace, name)))
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self._record("DELETED", obj)
        return str(self.rv)

    def get(self, name: str, namespace: str = "default", *, kind: str = "EndpointSlice") -> Obj:
        """A copy of the stored object (to change and ``put`` back)."""
        return copy.deepcopy(self.objects[(kind, namespace, name)])

    def compact(self, rv: int | None = None) -> None:
        """Forget history up to ``rv`` (default: now), as etcd compaction does."""
        self.compacted = self.rv if rv is None else rv
        self.history = [h for h in self.history if h[0] > self.compacted]
        self._snapshots = {k: v for k, v in self._snapshots.items() if k[-1] >= self.compacted}

    def bookmark(self) -> None:
        for w in self._watches:
            if w.bookmarks:
                meta = {"resourceVersion": str(self.rv), **_ZERO_META[w.kind]}
                obj = {"kind": w.kind, "apiVersion": _API_VERSION[w.kind], "metadata": meta}
                obj.update(copy.deepcopy(_ZERO[w.kind]))
                w.queue.put_nowait({"type": "BOOKMARK", "object": obj})

    def drop_watches(self) -> None:
        for w in self._watches:
            w.queue.put_nowait(_DROP)

    def expire_watches(self) -> None:
        """Tell every open watch its RV is too old (ERROR 410), as after a compaction the cache misses."""
        msg = f"too old resource version: {self.compacted - 1} ({self.rv})"
        for w in self._watches:
            w.queue.put_nowait({"type": "ERROR", "object": _status(410, "Expired", msg)})

    @property
    def open_watches(self) -> int:
        return len(self._watches)

    def watching(self, kind: str) -> int:
        """Open watches of one kind's collection."""
        return sum(1 for w in self._watches if w.kind == kind)

    def _record(self, kind: str, obj: Obj, prev: Obj | None = None) -> None:
        self.history.append((self.rv, kind, obj, prev))
        for w in self._watches:
            ev = _event_for(w, kind, obj, prev)
            if ev is not None:
                w.queue.put_nowait(ev)

    # ------------------------------------------------------------------ HTTP
    async def _handle(self, request: web.Request, kind: str = "EndpointSlice") -> web.StreamResponse:
        q = request.query
        params = dict(q)
        watch = q.get("watch") in _TRUE
        if self.token and request.headers.get("Authorization") != f"Bearer {self.token}":
            self.requests.append(
                Request("watch" if watch else "list", q.get("resourceVersion"), params, 401, kind)
            )
            return _answer(_status(401, "Unauthorized", "Unauthorized"), 401)
        ns = request.match_info["namespace"]
        sel = q.get("labelSelector", "")
        if watch:
            return await self._watch(request, ns, sel, params, kind)
        return self._list(ns, sel, params, kind)

    def _list(self, ns: str, sel: str, params: dict[str, str], kind: str = "EndpointSlice") -> web.Response:
        limit = int(params.get("limit", "0") or 0)
        token = params.get("continue")
        fields = params.get("fieldSelector", "")
        if token:
            snap_rv, after = decode_continue(token)
            items = self._snapshots.get((kind, ns, sel, fields, snap_rv))
            if items is None:
                self.requests.append(Request("list", str(snap_rv), params, 410, kind))
                again = {"continue": encode_continue(-1, after)}
                return _answer(_status(410, "Expired", INCONSISTENT_CONTINUE, again), 410)
            start = next((i for i, o in enumerate(items) if o["metadata"]["name"] >= after), len(items))
        else:
            snap_rv, start = self.rv, 0
            w = _Watch(kind, ns, sel, fields, False)
            keys = sorted(k for k, o in self.objects.items() if w.selects(o))
            items = [self.objects[k] for k in keys]
            if limit:
                self._snapshots[(kind, ns, sel, fields, snap_rv)] = items
        end = start + limit if limit else len(items)
        meta: Obj = {"resourceVersion": str(snap_rv)}
        if end < len(items):
            meta["continue"] = encode_continue(snap_rv, items[end - 1]["metadata"]["name"] + "\x00")
            meta["remainingItemCount"] = len(items) - end
        self.requests.append(Request("list", str(snap_rv), params, 200, kind))
        body = {"kind": f"{kind}List", "apiVersion": _API_VERSION[kind], "metadata": meta,
                "items": items[start:end]}  # fmt: skip
        return _answer(body)

    async def _watch(
        self, request: web.Request, ns: str, sel: str, params: dict[str, str], kind: str = "EndpointSlice"
    ) -> web.StreamResponse:
        rv_s = params.get("resourceVersion", "")
        rv = int(rv_s) if rv_s not in ("", "0") else None
        if rv is not None and rv < self.compacted and self.gone_as == "status":
            self.requests.append(Request("watch", rv_s, params, 410, kind))
            msg = f"too old resource version: {rv} ({self.compacted})"
            return _answer(_status(410, "Gone", msg), 410)
        self.requests.append(Request("watch", rv_s, params, 200, kind))
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        if rv is not None and rv < self.compacted:
            msg = f"too old resource version: {rv} ({self.compacted})"
            ev = {"type": "ERROR", "object": _status(410, "Expired", msg)}
            await resp.write(_encode(ev) + b"\n")
            await resp.write_eof()
            return resp
        entry = _Watch(
            kind, ns, sel, params.get("fieldSelector", ""), params.get("allowWatchBookmarks") == "true"
        )
        queue = entry.queue
        if rv is None:
            for o in sorted(self.objects.values(), key=lambda o: o["metadata"]["name"]):
                if entry.selects(o):
                    queue.put_nowait({"type": "ADDED", "object": o})
        else:
            for hrv, etype, o, prev in self.history:
                ev = _event_for(entry, etype, o, prev) if hrv > rv else None
                if ev is not None:
                    queue.put_nowait(ev)
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
