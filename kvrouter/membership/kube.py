"""The Kubernetes API, through lightkube (the shell of discovery): where the server is and how to prove who
we are, the three collections discovery reads, and the two calls of list-and-watch.

``KubeConnection`` builds lightkube's config (``api_url`` + token file + CA, or a kubeconfig and its
context, with exec plugins and client certificates); a token file is re-read when the server answers
401, as the kubelet rotates it.  ``KubeApi.list`` follows pages and returns the items and the list's
resourceVersion; ``KubeApi.watch`` yields (type, object), asks for BOOKMARKs, and re-watches from the
last version when the server ends a watch.

Objects decode straight into kvrouter's own msgspec types (``EndpointSlice``, ``Pod``,
``InferencePool``), so the pure parts never see the client.  Every failure comes out as one of
membership's errors: ``ResourceExpired`` (410, as a status or a watch ERROR event), ``ApiStatusError``
(any other status), ``BadWatchData`` (an object that does not decode), ``ApiUnreachable`` (connection
refused, reset, timed out).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterable, Mapping
from typing import Any, TypeVar

import httpx2
import msgspec
from lightkube import AsyncClient, KubeConfig
from lightkube.config.client_adapter import verify_cluster
from lightkube.config.kubeconfig import SingleConfig
from lightkube.config.models import Cluster, User
from lightkube.core.exceptions import ApiError
from lightkube.core.exceptions import ConfigError as LightkubeConfigError
from lightkube.core.resource import ApiInfo, NamespacedResourceG, ResourceDef

from indexer.errors import ConfigError

from .config import KubeConnection
from .endpointslices import EndpointSlice
from .errors import ApiStatusError, ApiUnreachable, BadWatchData, DiscoveryError, ResourceExpired
from .inferencepool import InferencePool
from .pods import Pod

_VERBS = ["list", "watch", "global_list", "global_watch"]


class EndpointSliceResource(EndpointSlice, NamespacedResourceG, frozen=True):
    _api_info = ApiInfo(
        resource=ResourceDef("discovery.k8s.io", "v1", "EndpointSlice"), plural="endpointslices", verbs=_VERBS
    )


class PodResource(Pod, NamespacedResourceG, frozen=True):
    _api_info = ApiInfo(resource=ResourceDef("", "v1", "Pod"), plural="pods", verbs=_VERBS)


class InferencePoolResource(InferencePool, NamespacedResourceG, frozen=True):
    _api_info = ApiInfo(
        resource=ResourceDef("inference.networking.k8s.io", "v1", "InferencePool"),
        plural="inferencepools",
        verbs=_VERBS,
    )


R = TypeVar("R", EndpointSliceResource, PodResource, InferencePoolResource)


class _Bookmarks(httpx2.AsyncBaseTransport):
    """Asks every watch for BOOKMARK events (lightkube's ``watch`` has no such parameter), and counts the
    requests it carries by kind (``list`` | ``watch``)."""

    def __init__(self, inner: httpx2.AsyncBaseTransport) -> None:
        self.inner = inner
        self.requests: dict[str, int] = {"list": 0, "watch": 0}

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        if request.url.params.get("watch") == "true":
            self.requests["watch"] += 1
            request.url = request.url.copy_set_param("allowWatchBookmarks", "true")
        else:
            self.requests["list"] += 1
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


def lightkube_config(conn: KubeConnection) -> tuple[SingleConfig, str]:
    """The client's configuration and the namespace to watch in."""
    if conn.kubeconfig is not None:
        try:
            single = KubeConfig.from_file(conn.kubeconfig).get(conn.context)
        except (LightkubeConfigError, OSError, KeyError, ValueError) as e:
            raise ConfigError(f"discovery: kubeconfig {conn.kubeconfig}: {e}") from None
        if single is None:
            raise ConfigError(f"discovery: kubeconfig {conn.kubeconfig} has no context {conn.context!r}")
        return single, conn.namespace or single.namespace or "default"
    cluster = Cluster(server=conn.base_url, certificate_auth=conn.ca_file, insecure=not conn.verify)
    user = User(token=conn.token, token_file=conn.token_file)
    kc = KubeConfig.from_one(cluster=cluster, user=user, namespace=conn.namespace)
    single = kc.get()
    assert single is not None
    return single, conn.namespace


def _api_error(e: Exception) -> DiscoveryError:
    """Membership's error for whatever the client raised."""
    event = False
    if isinstance(e, ApiError):
        event = e.response is None  # a watch ERROR event: a Status without an HTTP answer of its own
        code = e.status.code or (0 if event else e.response.status_code)
        message = e.status.message or ""
    elif isinstance(e, httpx2.HTTPStatusError):
        code, message = e.response.status_code, ""
    elif isinstance(e, (msgspec.DecodeError, msgspec.ValidationError, ValueError)):
        return BadWatchData(str(e))
    else:
        return ApiUnreachable(type(e).__name__, str(e))
    err: DiscoveryError
    if code == 410:
        err = ResourceExpired(message or "resourceVersion expired")
    else:
        err = ApiStatusError(code, message)
    err.event = event
    return err


_CLIENT_ERRORS = (
    ApiError,
    httpx2.HTTPError,
    httpx2.StreamError,
    msgspec.DecodeError,
    msgspec.ValidationError,
)


class KubeApi:
    """One client to one API server; ``close()`` when done."""

    def __init__(self, conn: KubeConnection, *, timeout_s: float = 30.0) -> None:
        self.config, self.namespace = lightkube_config(conn)
        user = self.config.user or User()
        verify = verify_cluster(self.config.cluster, user, self.config.abs_file)
        self.transport = _Bookmarks(httpx2.AsyncHTTPTransport(verify=verify))
        self.client = AsyncClient(
            self.config, namespace=self.namespace, timeout=httpx2.Timeout(timeout_s), transport=self.transport
        )

    @property
    def server(self) -> str:
        return self.config.cluster.server

    async def close(self) -> None:
        with contextlib.suppress(*_CLIENT_ERRORS, OSError):
            await self.client.close()

    async def list(
        self,
        res: type[R],
        *,
        labels: Mapping[str, str] | None = None,
        fields: Mapping[str, str] | None = None,
        page_size: int = 500,
    ) -> tuple[list[R], str]:
        """Every object of the selection, page after page of one snapshot, and its resourceVersion."""
        it = self.client.list(
            res,
            namespace=self.namespace,
            chunk_size=page_size,
            labels=dict(labels) if labels else None,
            fields=dict(fields) if fields else None,
        )
        try:
            items = [o async for o in it]
            return items, it.resourceVersion
        except _CLIENT_ERRORS as e:
            raise _api_error(e) from None
        except Exception as e:  # lightkube's NotReadyError: a list answered without a version
            if type(e).__name__ == "NotReadyError":
                raise BadWatchData("list: no resourceVersion") from None
            raise

    async def watch(
        self,
        res: type[R],
        *,
        resource_version: str,
        labels: Mapping[str, str] | None = None,
        fields: Mapping[str, str] | None = None,
        timeout_s: int = 300,
    ) -> AsyncGenerator[tuple[str, R], None]:
        """Events after ``resource_version`` until the caller stops; the client re-watches from the last
        version it saw each time the server ends a watch.  An ERROR event raises (410: ResourceExpired)."""
        events: AsyncIterable[tuple[str, Any]] = self.client.watch(
            res,
            namespace=self.namespace,
            labels=dict(labels) if labels else None,
            fields=dict(fields) if fields else None,
            resource_version=resource_version,
            server_timeout=timeout_s,
        )
        try:
            async for kind, obj in events:
                yield kind, obj
        except _CLIENT_ERRORS as e:
            raise _api_error(e) from None
        finally:
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(*_CLIENT_ERRORS, OSError, RuntimeError):
                    await aclose()
