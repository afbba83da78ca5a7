"""Prometheus exposition of the telemetry itself, read at scrape time:

::

    kvrouter_trace_requests_total                  requests traced (their spans handed to the exporter)
    kvrouter_trace_spans_total{result}             spans sent, failed (the receiver refused or was down),
                                                   dropped (the queue was full)
    kvrouter_access_log_lines_total                access-log lines written
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from .telemetry import Telemetry


class TelemetryCollector(Collector):
    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry

    def collect(self) -> Iterator[Metric]:
        sink = self.telemetry.sink
        if sink is not None:
            yield CounterMetricFamily(
                "kvrouter_trace_requests",
                "Requests traced (spans handed to the exporter)",
                value=sink.emitted,
            )
            spans = CounterMetricFamily("kvrouter_trace_spans", "Spans by export result", labels=["result"])
            for result, n in (("sent", sink.sent), ("failed", sink.failed), ("dropped", sink.dropped)):
                spans.add_metric([result], n)
            yield spans
        if self.telemetry.access.enabled:
            yield CounterMetricFamily(
                "kvrouter_access_log_lines", "Access-log lines written", value=self.telemetry.logged
            )
