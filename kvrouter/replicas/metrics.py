"""Prometheus metrics of shared router state, registered on the caller's registry (the gateway's)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_SYNC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class SharedStateMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry(auto_describe=False)
        self.errors = Counter(
            "kvrouter_shared_state_errors",
            "Failed round trips to the shared state store, by reason (routing went on with the local view; "
            "stalled: timed out while this process's event loop stood still, not counted as an outage)",
            ["reason"],
            registry=r,
        )
        self.up = Gauge(
            "kvrouter_shared_state_up",
            "1 if the last round trip to the shared state store succeeded",
            registry=r,
        )
        self.peers = Gauge(
            "kvrouter_shared_state_peers", "Other router replicas with a live lease", registry=r
        )
        self.sync_seconds = Histogram(
            "kvrouter_shared_state_sync_seconds",
            "Duration of one publish-and-read round trip",
            buckets=_SYNC_BUCKETS,
            registry=r,
        )
        self.peer_speculative = Counter(
            "kvrouter_shared_state_peer_speculative_entries",
            "Speculative entries taken in from other replicas",
            registry=r,
        )
        self.dropped_speculative = Counter(
            "kvrouter_shared_state_dropped_speculative_entries",
            "Own speculative entries never published (expired or over max_unsent while unreachable)",
            registry=r,
        )
