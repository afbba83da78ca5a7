"""EndpointSlices (``discovery.k8s.io/v1``) as far as discovery reads them, the list-and-watch cache, and
the instances they stand for (pure: no I/O).

``SliceCache.replace`` takes a LIST, ``apply`` each WATCH event (the resource version advances every
time), and ``instances(cfg)`` gives one InstanceConfig per ready endpoint: named for its pod
(``targetRef.name``), ``http://<ip>:<http port>``, events and replay on ``tcp://<ip>:<port>``,
``dp_size`` from the config, the slice's label, or 1.

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
from .kubetypes import ListMeta, ObjectCache, ObjectMeta, Status, WatchEvent

__all__ = [
    "EndpointSlice",
    "EndpointSliceList",
    "ListMeta",
    "ObjectMeta",
    "SliceCache",
    "Status",
    "WatchEvent",
]


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


class EndpointSliceList(msgspec.Struct, frozen=True):
    metadata: ListMeta = ListMeta()
    items: list[EndpointSlice] | None = None


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


class SliceCache(ObjectCache[EndpointSlice]):
    """The watched slices by name, and the collection's resourceVersion to resume the watch from."""

    @property
    def slices(self) -> dict[str, EndpointSlice]:
        return self.objects

    def instances(self, cfg: DiscoveryConfig) -> tuple[list[InstanceConfig], Counter[str]]:
        return instances_of(list(self.objects.values()), cfg)
