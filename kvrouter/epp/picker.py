"""``Picker``: what every exchange reads (the gateway's components, the picker's options and metrics).

The picker runs the same components as ``kvrouter serve`` (``gateway.Gateway``: indexer and its event
subscriber, router, upstream health and engine load, membership, token parity), only its front door is
Envoy's ext_proc stream instead of the aiohttp proxy.
"""

from __future__ import annotations

import msgspec

from indexer.errors import ConfigError

from ..gateway import Gateway
from .endpoints import EndpointMap
from .metrics import PickerMetrics
from .protocol import BODY_CHUNK


class PickerOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    grpc_host: str = "127.0.0.1"
    """Where the ext_proc gRPC server listens (``0.0.0.0`` in a pod)."""
    grpc_port: int = 9002
    fallbacks: int = 1
    """Endpoints named per request, best first.  1 (the choice alone) suits every gateway, Envoy's
    ORIGINAL_DST cluster included (it reads one address); a gateway that goes down the list on failure
    (Envoy's override_host policy, most Kubernetes gateways) can be given more: each fallback is the
    next-best target that is not saturated."""
    chunk_bytes: int = BODY_CHUNK
    """Largest body piece sent back to the gateway."""
    max_response_buffer: int = 8 << 20
    """An unstreamed answer is kept (to read its usage block) up to this size; past it, usage is unread."""

    def validate(self) -> None:
        if not 0 < self.grpc_port < 65536:
            raise ConfigError(f"epp: grpc port out of range: {self.grpc_port}")
        if self.fallbacks < 1:
            raise ConfigError("epp: fallbacks must be >= 1 (the choice itself)")
        if not 0 < self.chunk_bytes <= BODY_CHUNK:
            raise ConfigError(f"epp: chunk_bytes must be in 1..{BODY_CHUNK}")


class Picker:
    def __init__(self, gw: Gateway, options: PickerOptions | None = None) -> None:
        self.options = options = options or PickerOptions()
        options.validate()
        self.gw = gw
        self.cfg = gw.cfg
        self.pipeline = gw.pipeline
        self.pool = gw.pool
        self.metrics = PickerMetrics(gw.metrics.registry)
        self.fallbacks = options.fallbacks
        self.chunk_bytes = options.chunk_bytes

    def endpoints(self) -> EndpointMap:
        """Endpoint <-> instance for the instances in the pool now."""
        return EndpointMap(u.cfg for u in self.pool.upstreams.values())
