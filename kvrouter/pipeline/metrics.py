"""The request path's Prometheus metrics: decisions, predictions against what vLLM reported, shadow
scoring, admission.  Every front door (the proxy, the endpoint picker) records into these, on the
registry of the process that serves it (no process-global state)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from ..flows import FlowAccounts

# prometheus_client's labels() validates, stringifies and takes a lock on every call; the request path
# calls it about a dozen times.  These keep each child by its label values.  Children are never removed
# from these metrics, so a kept child is never stale.

_M = TypeVar("_M", bound="_KeepsChildren")


class _KeepsChildren(MetricWrapperBase):
    def labels(self: _M, *labelvalues: Any, **labelkwargs: Any) -> _M:
        if labelkwargs:
            return super().labels(*labelvalues, **labelkwargs)
        cache: dict[tuple[Any, ...], _M] = self.__dict__.setdefault("_kv_children", {})
        child = cache.get(labelvalues)
        if child is None:
            child = cache[labelvalues] = super().labels(*labelvalues)
        return child


class CachedCounter(_KeepsChildren, Counter):
    pass


class CachedHistogram(_KeepsChildren, Histogram):
    pass


class CachedGauge(_KeepsChildren, Gauge):
    pass


_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class PipelineMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = self.registry = registry
        self.decisions = CachedCounter(
            "kvrouter_decisions", "Routing decisions by policy and reason", ["policy", "reason"], registry=r
        )
        self.decision_seconds = Histogram(
            "kvrouter_routing_decision_seconds",
            "Render + tokenize + hash + look up + score, per request",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("kvrouter_prompt_tokens", "Prompt tokens routed", registry=r)
        self.predicted_cached = CachedCounter(
            "kvrouter_predicted_cached_tokens",
            "Cached prompt tokens the router predicted",
            ["target"],
            registry=r,
        )
        self.reported_cached = CachedCounter(
            "kvrouter_reported_cached_tokens",
            "Cached prompt tokens vLLM reported (usage.prompt_tokens_details.cached_tokens)",
            ["target"],
            registry=r,
        )
        self.routed_blocks = CachedCounter(
            "kvrouter_routed_cached_blocks",
            "Cached prompt blocks credited to the chosen targets, by tier (GPU, speculative, CPU, STORAGE, "
            "a shared store's name)",
            ["tier"],
            registry=r,
        )
        self.routed_credit = CachedCounter(
            "kvrouter_routed_cached_block_value",
            "The same blocks at their tier's worth (GPU blocks 1 each; slower tiers what loading saves)",
            ["tier"],
            registry=r,
        )
        self.latency_error = CachedHistogram(
            "kvrouter_latency_prediction_error_ratio",
            "|predicted - observed| / observed, per request whose target's latency model was warm",
            ["kind"],
            buckets=(0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 1, 2, 5),
            registry=r,
        )
        self.latency_observations = CachedCounter(
            "kvrouter_latency_observations",
            "Observed TTFT and TPOT by what became of them: used, clipped (an outlier, bounded before it "
            "trained the model), invalid (not finite, not positive or too long: dropped); and requests that "
            "taught nothing: unary (the answer came whole), no_pace (a stream without its token count)",
            ["kind", "outcome"],
            registry=r,
        )
        self.cached_error = Histogram(
            "kvrouter_cached_tokens_error",
            "Predicted minus reported cached tokens, per request with a usage report",
            buckets=(-8192, -2048, -512, -128, -16, -1, 0, 1, 16, 128, 512, 2048, 8192),
            registry=r,
        )
        self.spills = Counter(
            "kvrouter_spills", "Requests spilled past the concurrency threshold", registry=r
        )
        self.rejections = CachedCounter(
            "kvrouter_rejections", "Requests rejected, by reason", ["reason"], registry=r
        )
        self.queue_depth = Gauge("kvrouter_queue_depth", "Requests waiting for capacity", registry=r)
        self.shadow_cached = CachedCounter(
            "kvrouter_shadow_cached_tokens",
            "Cached tokens each policy's choice would have had (shadow scoring, incl. the active policy)",
            ["policy"],
            registry=r,
        )
        self.parity_checks = CachedCounter(
            "kvrouter_token_parity_checks",
            "Token-parity checks against the fleet, by model, route (chat, completions, pooling, responses, "
            "messages), method (tokenize, render, cached_tokens) and result (match, mismatch, error, "
            "unsupported, shortfall)",
            ["model", "route", "method", "result"],
            registry=r,
        )
        self.mm_items = CachedCounter(
            "kvrouter_multimodal_items",
            "Media items of routed requests, by how the router learnt them: uuid (named, size not needed), "
            "uuid_cached (named, size seen before), data (a data: URL decoded and hashed), prefix_only (an "
            "http(s) URL or an item it cannot size: the request routes on the blocks before it)",
            ["path"],
            registry=r,
        )
        self.untokenized = CachedCounter(
            "kvrouter_untokenized_requests",
            "Requests routed without token ids although their model has a tokenizer, by reason (media not "
            "reproduced: media_not_base64, media_too_large, media_placeholders; unsupported: other options)",
            ["reason"],
            registry=r,
        )
        self.shadow_agree = CachedCounter(
            "kvrouter_shadow_agreement",
            "Requests where a shadow policy chose the same target",
            ["policy"],
            registry=r,
        )
        self.shadow_scored = Counter(
            "kvrouter_shadow_scored",
            "Decisions shadow-scored (one in routing.shadow_every): the denominator of the shadow metrics",
            registry=r,
        )
        self.pd = DisaggMetrics(r)
        self.flows = FlowMetrics(r)


class FlowMetrics:
    """Per flow (tenant, priority): the queue, its waits, refusals and the work admitted.  Tenants not in
    the fleet file (named by a header) are counted as ``other``: the labels stay bounded."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.depth = CachedGauge(
            "kvrouter_flow_queue_depth",
            "Requests waiting for capacity, per flow",
            ["tenant", "priority"],
            registry=r,
        )
        self.wait = CachedHistogram(
            "kvrouter_flow_queue_wait_seconds",
            "Time from admission to capacity, per flow (0 for requests that did not wait)",
            ["tenant", "priority"],
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.admitted = CachedCounter(
            "kvrouter_flow_admitted", "Requests given capacity, per flow", ["tenant", "priority"], registry=r
        )
        self.shed = CachedCounter(
            "kvrouter_flow_shed",
            "Requests refused for want of capacity, per flow and reason (queue_full, queue_timeout, "
            "expected_timeout, displaced, sheddable, shutting_down)",
            ["tenant", "priority", "reason"],
            registry=r,
        )
        self.rate_limited = CachedCounter(
            "kvrouter_flow_rate_limited",
            "Requests refused by their tenant's rate limits (requests or tokens per minute)",
            ["tenant"],
            registry=r,
        )
        self.work = CachedCounter(
            "kvrouter_flow_work_tokens",
            "Tokens the fleet was asked to compute per flow: prompt tokens not cached where each request "
            "went, plus its decode (expected at admission, corrected by vLLM's report): the share of work",
            ["tenant", "priority"],
            registry=r,
        )
        self.heavy = CachedCounter(
            "kvrouter_flow_heavy",
            "Requests admitted while their flow was heavy (over its share of the work, or below "
            "limits.isolation.quiet_priority): kept off the quiet instances, per flow",
            ["tenant", "priority"],
            registry=r,
        )
        self.slo = CachedCounter(
            "kvrouter_flow_slo",
            "Requests stating a TTFT or TPOT objective, per tenant and outcome (met: predicted to meet it; "
            "rejected_ttft, rejected_tpot, demoted_ttft, demoted_tpot: predicted to miss it)",
            ["tenant", "outcome"],
            registry=r,
        )
        self.header_warnings = CachedCounter(
            "kvrouter_flow_header_warnings",
            "Tenant or priority headers ignored or changed, by header and reason (malformed, needs_key, "
            "not_allowed, snapped: a priority between the configured levels)",
            ["header", "reason"],
            registry=r,
        )


class FlowAccountsCollector(Collector):
    """The flow accounts, read at scrape time: ``kvrouter_flow_accounts`` (flows whose service is
    counted) and ``kvrouter_flow_accounts_forgotten_total`` (forgotten past ``flows.max_flows``, or past
    the host's table under ``--workers``: worker 0 reports the host's, which the merge would otherwise
    count once per worker)."""

    def __init__(self, accounts: FlowAccounts) -> None:
        self.accounts = accounts

    def collect(self) -> Iterator[Metric]:
        census = self.accounts.census()
        if census is None:
            return
        held, forgotten = census
        yield GaugeMetricFamily(
            "kvrouter_flow_accounts",
            "Flows (tenant, priority) whose service is counted, at most flows.max_flows (the host's table "
            "under --workers)",
            value=held,
        )
        yield CounterMetricFamily(
            "kvrouter_flow_accounts_forgotten",
            "Flows forgotten past that bound (least recently charged, none waiting): they come back as new "
            "flows",
            value=forgotten,
        )


class DisaggMetrics:
    """Disaggregated requests: how each was planned, and both of its legs."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.plans = CachedCounter(
            "kvrouter_pd_decisions",
            "Requests of disaggregated models, split (prefill and decode legs) or whole, by reason",
            ["mode", "reason"],
            registry=r,
        )
        self.legs = CachedCounter(
            "kvrouter_pd_legs",
            "Legs sent: prefill legs to prefill instances, decode legs to decode instances",
            ["leg", "target"],
            registry=r,
        )
        self.leg_failures = CachedCounter(
            "kvrouter_pd_leg_failures",
            "Legs that failed before their answer began, by reason",
            ["leg", "reason"],
            registry=r,
        )
        self.fallbacks = CachedCounter(
            "kvrouter_pd_fallbacks",
            "Split requests served whole after a leg failed (prefill pool exhausted, decode leg failed)",
            ["reason"],
            registry=r,
        )
        self.prefill_seconds = Histogram(
            "kvrouter_pd_prefill_leg_seconds",
            "Prefill leg: sent to answered (the prompt computed and held)",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
