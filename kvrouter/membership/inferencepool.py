"""The ``InferencePool`` (``inference.networking.k8s.io/v1``, Gateway API Inference Extension) as discovery
reads it, and what it asks of discovery: which pods, which ports (pure: no I/O).

::

    spec.selector.matchLabels  ──▶ PoolTarget.selector   the pods (same namespace), by label equality
    spec.targetPorts[].number  ──▶ PoolTarget.ports      each one an endpoint ``podIP:port`` of its own
    spec.appProtocol, spec.endpointPickerRef             read and shown, not acted on: the gateway's

The API validates a pool (1..64 labels, 1..8 unique ports in 1..65535); one that is not valid anyway (a
conversion gone wrong, an old CRD) is refused here with a reason and selects nothing.
"""

from __future__ import annotations

import msgspec

from .kubetypes import ObjectMeta


class LabelSelector(msgspec.Struct, frozen=True, rename="camel"):
    match_labels: dict[str, str] | None = None
    """Every label must match (AND); the pool's is equality-only by design (a Service's selector)."""


class PoolPort(msgspec.Struct, frozen=True):
    number: int = 0


class EndpointPickerRef(msgspec.Struct, frozen=True, rename="camel"):
    group: str | None = None
    kind: str = "Service"
    name: str = ""
    """The picker's Service (this process, if the pool names kvrouter)."""
    port: PoolPort | None = None
    failure_mode: str = "FailClose"
    """``FailOpen`` or ``FailClose``: what the gateway does when the picker does not answer."""


class InferencePoolSpec(msgspec.Struct, frozen=True, rename="camel"):
    selector: LabelSelector = LabelSelector()
    target_ports: list[PoolPort] | None = None
    app_protocol: str = "http"
    """``http`` or ``kubernetes.io/h2c`` (the model servers' protocol, for the gateway)."""
    endpoint_picker_ref: EndpointPickerRef | None = None


class InferencePool(msgspec.Struct, frozen=True):
    metadata: ObjectMeta = ObjectMeta()
    spec: InferencePoolSpec = InferencePoolSpec()


class PoolTarget(msgspec.Struct, frozen=True):
    """What discovery follows of a pool: a change of either re-reads the pods."""

    selector: dict[str, str]
    ports: list[int]
    """In the pool's order: port ``i`` is rank ``i`` of a pod serving several."""

    def label_selector(self) -> str:
        """``k=v,k2=v2`` (sorted), as the API server's ``labelSelector`` parameter takes it."""
        return ",".join(f"{k}={v}" for k, v in sorted(self.selector.items()))

    def matches(self, labels: dict[str, str] | None) -> bool:
        got = labels or {}
        return all(got.get(k) == v for k, v in self.selector.items())


class PoolRefused(ValueError):
    """A pool that selects nothing usable; ``reason`` is a metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def pool_target(pool: InferencePool) -> PoolTarget:
    """The pods and ports ``pool`` asks for.  Raises ``PoolRefused`` (``selector`` | ``ports``)."""
    sel = dict(pool.spec.selector.match_labels or {})
    if not sel:
        raise PoolRefused("selector", f"{pool.metadata.name}: empty selector (would select every pod)")
    ports = [p.number for p in pool.spec.target_ports or []]
    if not ports:
        raise PoolRefused("ports", f"{pool.metadata.name}: no targetPorts")
    bad = [p for p in ports if not 0 < p < 65536]
    if bad or len(set(ports)) != len(ports):
        raise PoolRefused("ports", f"{pool.metadata.name}: targetPorts {ports} (1..65535, each once)")
    return PoolTarget(sel, ports)
