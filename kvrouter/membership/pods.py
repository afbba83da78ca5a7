"""Pods (``v1``) as pool discovery reads them, and the instances an InferencePool's pods stand for (pure).

A pod is in rotation when its Ready condition is True, it has no deletionTimestamp and it has a podIP.
It gives one InstanceConfig per target port ``p_i`` of the pool (only those its ``active-ports``
annotation lists, if any): named for the pod (one port) or ``<pod>-rank-<i>`` (several), with
``http://<podIP>:<p_i>``, events and replay on ``tcp://<podIP>:<port + i>`` (the fleet file's port, a
container port's name or a number; none: vLLM's /kv_event_sources is asked), and ``dp_size`` from the
config, the pod's label ``dp_size_label``, or 1.

This is the reference Endpoint Picker's reading of a pool, with our own name for the single-port case so
that a pod keeps its name across EndpointSlice and pool discovery.  The ``+ i`` on event ports is
vLLM's rank offset for a pod whose ports are data-parallel ranks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import msgspec

from indexer.config import InstanceConfig, offset_endpoint

from .config import DiscoveryConfig
from .inferencepool import PoolTarget
from .kubetypes import ObjectMeta

ACTIVE_PORTS = "inference.networking.k8s.io/active-ports"
"""Pod annotation: the target ports (comma-separated numbers) taking traffic now; absent: all of them."""


class ContainerPort(msgspec.Struct, frozen=True, rename="camel"):
    name: str | None = None
    container_port: int = 0


class Container(msgspec.Struct, frozen=True):
    name: str = ""
    ports: list[ContainerPort] | None = None


class PodSpec(msgspec.Struct, frozen=True):
    containers: list[Container] | None = None
    """Null in a BOOKMARK's zero-valued pod."""


class PodCondition(msgspec.Struct, frozen=True):
    type: str = ""
    status: str = ""
    """``True``, ``False`` or ``Unknown`` (strings, as the API writes them)."""


class PodStatus(msgspec.Struct, frozen=True):
    phase: str = ""
    pod_ip: str | None = msgspec.field(default=None, name="podIP")
    conditions: list[PodCondition] | None = None


class Pod(msgspec.Struct, frozen=True):
    metadata: ObjectMeta = ObjectMeta()
    spec: PodSpec = PodSpec()
    status: PodStatus = PodStatus()


def ready(pod: Pod) -> bool:
    """In rotation: the kubelet says Ready and the pod is not being deleted."""
    if pod.metadata.deletion_timestamp:
        return False
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def container_port(pod: Pod, spec: str | int | None) -> int | None:
    """A port by container-port name (the first container declaring it), or the number itself."""
    if spec is None or isinstance(spec, int):
        return spec
    for c in pod.spec.containers or []:
        for p in c.ports or []:
            if p.name == spec and p.container_port:
                return p.container_port
    return None


def active_ports(pod: Pod, ports: list[int]) -> list[int]:
    """The target ports the pod takes traffic on: all, or those its annotation lists (unknown or
    malformed entries ignored, as the reference picker does)."""
    raw = (pod.metadata.annotations or {}).get(ACTIVE_PORTS)
    if raw is None:
        return list(ports)
    listed = {int(t) for t in (s.strip() for s in raw.split(",")) if t.isdigit()}
    return [p for p in ports if p in listed]


def _dp_size(pod: Pod, cfg: DiscoveryConfig, skipped: Counter[str]) -> int:
    if cfg.dp_size is not None:
        return cfg.dp_size
    raw = (pod.metadata.labels or {}).get(cfg.dp_size_label)
    if raw is None:
        return 1
    n = int(raw) if raw.isdigit() else 0
    if n < 1:
        skipped["bad_dp_size"] += 1
        return 1
    return n


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


def pool_instances(
    pods: Iterable[Pod], target: PoolTarget, cfg: DiscoveryConfig
) -> tuple[list[InstanceConfig], Counter[str]]:
    """The instances of the pool's pods in rotation, sorted by name, and what was left out (by reason)."""
    out: dict[str, InstanceConfig] = {}
    skipped: Counter[str] = Counter()
    several = len(target.ports) > 1
    for pod in sorted(pods, key=lambda p: p.metadata.name):
        if not target.matches(pod.metadata.labels) or not ready(pod):
            continue
        ip = pod.status.pod_ip
        if not ip:
            skipped["no_address"] += 1
            continue
        active = set(active_ports(pod, target.ports))
        if not active:
            skipped["no_active_port"] += 1
            continue
        host = _host(ip)
        events, replay = container_port(pod, cfg.events_port), container_port(pod, cfg.replay_port)
        if cfg.events_port is not None and events is None:
            skipped["no_events_port"] += 1  # its /kv_event_sources is asked instead
        dp = _dp_size(pod, cfg, skipped)
        for i, port in enumerate(target.ports):
            if port not in active:
                continue
            name = f"{pod.metadata.name}-rank-{i}" if several else pod.metadata.name
            out[name] = InstanceConfig(
                name=name,
                url=f"http://{host}:{port}",
                events=None if events is None else offset_endpoint(f"tcp://{host}:{events}", i),
                replay=None if replay is None else offset_endpoint(f"tcp://{host}:{replay}", i),
                topic=cfg.topic,
                dp_size=dp,
                models=list(cfg.models),
                weight=cfg.weight,
            )
    return [out[n] for n in sorted(out)], skipped
