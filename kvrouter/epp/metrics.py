"""The picker's own Prometheus metrics, beside the request path's (``pipeline.metrics``, where decisions,
predicted and reported cached tokens are) on the gateway's registry: one ``/metrics`` shows both."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from ..pipeline.metrics import CachedCounter, CachedHistogram

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class PickerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.streams = Counter("kvrouter_epp_streams", "ext_proc streams opened by the gateway", registry=r)
        self.open_streams = Gauge("kvrouter_epp_open_streams", "ext_proc streams open now", registry=r)
        self.stream_errors = CachedCounter(
            "kvrouter_epp_stream_errors",
            "ext_proc streams that ended in an error, by type",
            ["error"],
            registry=r,
        )
        self.picks = CachedCounter(
            "kvrouter_epp_picks",
            "Requests given a destination, by policy and reason",
            ["policy", "reason"],
            registry=r,
        )
        self.immediate = CachedCounter(
            "kvrouter_epp_immediate_responses",
            "Requests answered by the picker itself (no upstream), by status and reason",
            ["status", "reason"],
            registry=r,
        )
        self.fallbacks = CachedCounter(
            "kvrouter_epp_fallbacks_served",
            "Answers served by a fallback endpoint (the first one named failed), by the target that served",
            ["target"],
            registry=r,
        )
        self.served_unknown = Counter(
            "kvrouter_epp_served_unknown",
            "Answers the gateway reports served by an endpoint the picker did not name",
            registry=r,
        )
        self.upstream_ttft = CachedHistogram(
            "kvrouter_epp_upstream_ttft_seconds",
            "From the destination given to the first response byte (streamed) or the whole answer",
            ["target"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
