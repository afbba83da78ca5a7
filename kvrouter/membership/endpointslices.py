"""EndpointSlices (``discovery.k8s.io/v1``) as far as discovery reads them, the list-and-watch cache, and
the instances they stand for (pure: no I/O).

::

    LIST  ──▶ SliceCache.replace(items, list RV)
    WATCH ──▶ SliceCache.apply(ADDED | MODIFIED | DELETED | BOOKMARK, object)   (RV advances every time)
    SliceCache.instances(cfg) ──▶ one InstanceConfig per ready endpoint:
        name    targetRef.name (the pod)            url     http://<ip>:<http port>
        events  tcp://<ip>:<events port>            replay  tcp://<ip>:<replay port>
        dp_size cfg.dp_size | slice label | 1

Only IPv4 slices are read (the fleet's ZeroMQ endpoints are ``tcp://host:port``); an endpoint counts when
``conditions.ready`` is true or unset (the API: "nil should be interpreted as ready").  A pod may appear in
two slices while the controller moves it: the first slice by name wins.  Resource versions are opaque
strings (compared for equality only, never ordered).
"""

from __future__ import annotations

from collections import Counter

import msgspec

from indexer.config import InstanceConfig

from .config import DiscoveryConfig


class ObjectMeta(msgspec.Struct, frozen=True, rename="camel"):
    name: str = ""
    """Object name (unique per namespace)."""
    namespace: str = ""
    resource_version: str = ""
    """Opaque version of this object (for a BOOKMARK: of the whole collection)."""
    labels: dict[str, str] | None = None
    """Slices carry their Service's labels plus ``kubernetes.io/service-name``."""


class Conditions(msgspec.Struct, frozen=True):
    ready: bool | None = None
    """Ready for traffic; None means ready."""
    serving: bool | None = None
    terminating: bool | None = None


class ObjectReference(msgspec.Struct, frozen=True):
    kind: str = ""
    """``Pod`` for a Service's endpoints."""
    name: str = ""
    namespace: str = ""


class Endpoint(msgspec.Struct, frozen=True, rename="camel"):
    addresses: list[str] = []
    """IP addresses of the pod (the first is used)."""
    conditions: Conditions = Conditions()
    target_ref: ObjectReference | None = None
    """The pod behind the endpoint."""
    hostname: str | None = None
    node_name: str | None = None


class EndpointPort(msgspec.Struct, frozen=True):
    name: str | None = None
    """The Service port's name; ports are the pods' (target) ports."""
    port: int | None = None
    protocol: str | None = None


class EndpointSlice(msgspec.Struct, frozen=True, rename="camel"):
    metadata: ObjectMeta = ObjectMeta()
    address_type: str = "IPv4"
    """IPv4, IPv6 or FQDN."""
    endpoints: list[Endpoint] | None = None
    """Null in JSON when the Service has no endpoints."""
    ports: list[EndpointPort] | None = None


class ListMeta(msgspec.Struct, frozen=True, rename="camel"):
    resource_version: str = ""
    """The collection's version at the time of the list: where the watch starts."""
    continue_: str | None = msgspec.field(default=None, name="continue")
    """Token for the next page; absent or empty on the last."""


class EndpointSliceList(msgspec.Struct, frozen=True):
    metadata: ListMeta = ListMeta()
    items: list[EndpointSlice] | None = None


class Status(msgspec.Struct, frozen=True):
    """The API's error object: a non-2xx body, or the object of a watch ERROR event."""

    code: int = 0
    """HTTP-like code: 410 for an expired resourceVersion."""
    reason: str = ""
    """Machine-readable: ``Expired``, ``Gone``, ``Unauthorized``..."""
    message: str = ""


class WatchEvent(msgspec.Struct, frozen=True):
    type: str
    """ADDED, MODIFIED, DELETED, BOOKMARK or ERROR."""
    object: msgspec.Raw
    """An EndpointSlice (a BOOKMARK's holds only metadata.resourceVersion) or, for ERROR, a Status."""


def _port(s: EndpointSlice, spec: str | int | None) -> int | None:
    if spec is None or isinstance(spec, int):
        return spec
    return next((p.port for p in s.ports or [] if p.name == spec), None)


def _dp_size(s: EndpointSlice, cfg: DiscoveryConfig, skipped: Counter[str]) -> int:
    if cfg.dp_size is not None:
        return cfg.dp_size
    raw = (s.metadata.labels or {}).get(cfg.dp_size_label)
    if raw is None:
        return 1
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        skipped["bad_dp_size"] += 1
        return 1
    return n


def instances_of(
    slices: list[EndpointSlice], cfg: DiscoveryConfig
) -> tuple[list[InstanceConfig], Counter[str]]:
    """The instances of the ready endpoints, sorted by name, and what was skipped (by reason)."""
    out: dict[str, InstanceConfig] = {}
    skipped: Counter[str] = Counter()
    for s in sorted(slices, key=lambda s: s.metadata.name):
        if s.address_type != "IPv4":
            skipped["address_type"] += len(s.endpoints or [])
            continue
        http, events, replay = (_port(s, p) for p in (cfg.http_port, cfg.events_port, cfg.replay_port))
        for ep in s.endpoints or []:
            if ep.conditions.ready is False:
                continue
            if http is None or not ep.addresses:
                skipped["no_http_port" if http is None else "no_address"] += 1
                continue
            if cfg.events_port is not None and events is None:
                skipped["no_events_port"] += 1  # still routable, by load only
            ip = ep.addresses[0]
            name = ep.target_ref.name if ep.target_ref and ep.target_ref.name else f"{cfg.service}-{ip}"
            if name in out:
                skipped["duplicate"] += 1
                continue
            out[name] = InstanceConfig(
                name=name,
                url=f"http://{ip}:{http}",
                events=None if events is None else f"tcp://{ip}:{events}",
                replay=None if replay is None else f"tcp://{ip}:{replay}",
                topic=cfg.topic,
                dp_size=_dp_size(s, cfg, skipped),
                models=list(cfg.models),
                weight=cfg.weight,
            )
    return [out[n] for n in sorted(out)], skipped


class SliceCache:
    """The watched slices by name, and the collection's resourceVersion to resume the watch from."""

    def __init__(self) -> None:
        self.slices: dict[str, EndpointSlice] = {}
        self.resource_version: str = ""

    def replace(self, items: list[EndpointSlice], resource_version: str) -> None:
        """A (re)list: the items are the whole truth as of ``resource_version``."""
        self.slices = {s.metadata.name: s for s in items}
        self.resource_version = resource_version

    def apply(self, kind: str, obj: EndpointSlice) -> bool:
        """One watch event; True if the slices changed (a BOOKMARK only moves the version)."""
        if obj.metadata.resource_version:
            self.resource_version = obj.metadata.resource_version
        name = obj.metadata.name
        if kind in ("ADDED", "MODIFIED"):
            self.slices[name] = obj
            return True
        if kind == "DELETED":
            return self.slices.pop(name, None) is not None
        return False

    def instances(self, cfg: DiscoveryConfig) -> tuple[list[InstanceConfig], Counter[str]]:
        return instances_of(list(self.slices.values()), cfg)
