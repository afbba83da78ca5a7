"""The proxy's own Prometheus metrics (HTTP, upstreams, streams), beside the request path's
(``pipeline.metrics``) on one registry of its own (no process-global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from ..pipeline.metrics import CachedCounter, CachedHistogram, PipelineMetrics

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry(auto_describe=False)
        self.pipeline = PipelineMetrics(r)
        self.requests = CachedCounter(
            "kvrouter_requests", "Requests by route and status", ["route", "status"], registry=r
        )
        self.in_flight = Gauge(
            "kvrouter_instance_in_flight", "Requests in flight per target", ["target"], registry=r
        )
        self.healthy = Gauge(
            "kvrouter_instance_healthy", "1 if the target is in rotation", ["target"], registry=r
        )
        self.retries = CachedCounter(
            "kvrouter_retries",
            "Retries before the first byte, by reason: on another instance, or on the same one when the"
            " connection timed out while the router stood still (stalled)",
            ["reason"],
            registry=r,
        )
        self.failures_excused = Counter(
            "kvrouter_upstream_failures_excused",
            "Attempts that failed before the first byte on a timeout while the router's own event loop stood "
            "still for much of the wait: not counted against their instance (failure_threshold)",
            ["instance"],
            registry=r,
        )
        self.ejections = Counter(
            "kvrouter_instance_ejections",
            "Instances taken out of rotation for a while after failed requests (outlier ejection)",
            ["instance"],
            registry=r,
        )
        self.internal_errors = Counter(
            "kvrouter_internal_errors",
            "Requests answered 500 by a bug in the gateway, by exception type",
            ["error"],
            registry=r,
        )
        self.upstream_ttft = CachedHistogram(
            "kvrouter_upstream_ttft_seconds",
            "Time from dispatch to the first streamed token (or to the response, unstreamed)",
            ["target"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.client_disconnects = Counter("kvrouter_client_disconnects", "Clients that went away", registry=r)
        self.stream_errors = Counter(
            "kvrouter_stream_errors", "Streams ended with an error event after they began", registry=r
        )
        self.loop_tasks = Gauge(
            "kvrouter_event_loop_tasks",
            "Tasks alive on the gateway's event loop when scraped (a steady climb is a leak)",
            registry=r,
        )
        self.events_deaf = Gauge(
            "kvrouter_event_source_deaf",
            "1 while a source's live KV-event stream is silent though its instance computed prompts "
            "(its events go elsewhere: routing on it is approximate)",
            ["source"],
            registry=r,
        )
        self.events_refused = Gauge(
            "kvrouter_event_source_refused",
            "1 for an instance whose announced KV-event stream this router cannot receive",
            ["instance"],
            registry=r,
        )
        self.loop_lag = Gauge(
            "kvrouter_event_loop_lag_seconds",
            "How far the gateway's event loop is behind when scraped (its least delay over the last 0.1 s; "
            "admission refuses past limits.max_loop_lag_s)",
            registry=r,
        )
        self.loop_demand = Gauge(
            "kvrouter_event_loop_demand",
            "Share of the last 0.1 s the event loop's thread was runnable (on a CPU or queued for one): "
            "1 when it never idles, its CPU the bottleneck",
            registry=r,
        )
        self.loop_stall_max = Gauge(
            "kvrouter_event_loop_stall_max_seconds",
            "The longest the gateway's event loop stood still since start (a collection, a burst of work)",
            registry=r,
        )
        self.worker = Gauge(
            "kvrouter_worker",
            "1 per worker of the host, labelled with it (serve --workers N: every scrape shows them all)",
            ["worker"],
            registry=r,
        )
