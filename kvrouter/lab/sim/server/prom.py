"""``/metrics`` of a simulated instance: vLLM's metric names and labels, one registry per app.

::

    GET /metrics ──▶ CollectorRegistry (per app) ──▶ SimCollector.collect()
                                                        ├── engine.metrics() per rank   (gauges, counters)
                                                        └── RequestStats per rank       (histograms,
                                                                                         request_success)

Every family carries ``model_name`` and ``engine`` (the data-parallel rank), as vLLM v1 labels them, so the
gateway's scrape (``vllm:num_requests_running`` / ``waiting`` per ``engine``) reads them unchanged.  Values
are read from the engines at scrape time; nothing is global.  A crash resets every counter and histogram
of the instance, as a restarted vLLM process does.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from kvrouter.lab.sim.engine.engine import Engine

# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort")


class Histogram:
    """Bucket counts and a sum, exposed by ``SimCollector`` (no prometheus_client global state)."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, v)] += 1
        self.total += v

    def cumulative(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        acc = 0
        for b, c in zip(self.bounds, self.counts):
            acc += c
            out.append((repr(float(b)), acc))
        out.append(("+Inf", acc + self.counts[-1]))
        return out


class RequestStats:
    """What the HTTP shell measures per rank (the engine model has no clock)."""

    __slots__ = ("e2e", "finished", "itl", "ttft")

    def __init__(self) -> None:
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.finished = dict.fromkeys(FINISH_REASONS, 0)


class SimCollector:
    """A prometheus_client collector over an instance's ranks.  ``ranks`` is called at each scrape, so a
    crash that rebuilds the stats is seen at once."""

    def __init__(self, model_name: str, ranks: Callable[[], Sequence[tuple[Engine, RequestStats]]]) -> None:
        self.model_name = model_name
        self._ranks = ranks

    def describe(self) -> list[Metric]:
        return []  # collected lazily; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name", "engine"]
        g = {
            name: GaugeMetricFamily(name, doc, labels=labels)
            for name, doc in (
                ("vllm:num_requests_running", "Number of requests in model execution batches."),
                ("vllm:num_requests_waiting", "Number of requests waiting to be processed."),
                ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
            )
        }
        c = {
            name: CounterMetricFamily(name, doc, labels=labels)
            for name, doc in (
                ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."),
                ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
                ("vllm:external_prefix_cache_queries", "External prefix cache queries (tokens)."),
                ("vllm:external_prefix_cache_hits", "External prefix cache hits (tokens)."),
                ("vllm:num_preemptions", "Cumulative number of preemptions from the engine."),
                ("vllm:prompt_tokens", "Number of prefill tokens processed."),
                ("vllm:generation_tokens", "Number of generation tokens processed."),
            )
        }
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*labels, "finished_reason"],
        )
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=[*labels, "block_size", "num_gpu_blocks", "enable_prefix_caching"],
        )
        hists = {
            "ttft": HistogramMetricFamily(
                "vllm:time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                labels=labels,
            ),
            "itl": HistogramMetricFamily(
                "vllm:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                labels=labels,
            ),
            "e2e": HistogramMetricFamily(
                "vllm:e2e_request_latency_seconds",
                "Histogram of e2e request latency in seconds.",
                labels=labels,
            ),
        }
        for rank, (engine, stats) in enumerate(self._ranks()):
            lv = [self.model_name, str(rank)]
            m = engine.metrics()
            g["vllm:num_requests_running"].add_metric(lv, m.num_requests_running)
            g["vllm:num_requests_waiting"].add_metric(lv, m.num_requests_waiting)
            g["vllm:kv_cache_usage_perc"].add_metric(lv, m.kv_cache_usage_perc)
            c["vllm:prefix_cache_queries"].add_metric(lv, m.prefix_cache_queries_total)
            c["vllm:prefix_cache_hits"].add_metric(lv, m.prefix_cache_hits_total)
            c["vllm:external_prefix_cache_queries"].add_metric(lv, m.external_prefix_cache_queries_total)
            c["vllm:external_prefix_cache_hits"].add_metric(lv, m.external_prefix_cache_hits_total)
            c["vllm:num_preemptions"].add_metric(lv, m.num_preemptions_total)
            c["vllm:prompt_tokens"].add_metric(lv, m.prompt_tokens_total)
            c["vllm:generation_tokens"].add_metric(lv, m.generation_tokens_total)
            for reason, n in stats.finished.items():
                success.add_metric([*lv, reason], n)
            cc = engine.config.cache
            info.add_metric(
                [*lv, str(engine.block_size), str(engine.num_gpu_blocks), str(cc.enable_prefix_caching)], 1.0
            )
            for key, fam in hists.items():
                h: Histogram = getattr(stats, key)
                fam.add_metric(lv, h.cumulative(), h.total)
        yield from g.values()
        yield from c.values()
        yield success
        yield info
        yield from hists.values()
