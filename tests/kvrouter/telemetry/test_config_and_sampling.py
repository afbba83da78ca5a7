"""The tracing configuration from the fleet file and the standard OTEL_* variables, and which requests are
traced or logged."""

from __future__ import annotations

import random

import pytest

from indexer.errors import ConfigError
from kvrouter.telemetry import AccessLogConfig, Telemetry, TracingConfig, parse_traceparent, traceparent
from kvrouter.telemetry.export import SpanSink


class Nothing:
    def send(self, payload: bytes) -> bool:
        return True

    def shutdown(self) -> None:
        pass


def test_variables_override_the_file() -> None:
    base = TracingConfig(sample_rate=0.5, endpoint="http://file:4318")
    env = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.25",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318",
        "OTEL_SERVICE_NAME": "router-a",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
    }
    cfg = base.with_env(env)
    assert cfg.enabled and cfg.sample_rate == 0.25 and cfg.parent_based
    assert cfg.traces_endpoint == "http://collector:4318/v1/traces"
    assert cfg.service_name == "router-a" and cfg.schedule_delay_s == pytest.approx(0.2)
    assert base.with_env({}) == base
    assert not TracingConfig(enabled=True).with_env({"OTEL_SDK_DISABLED": "true"}).enabled
    assert TracingConfig().with_env({"OTEL_TRACES_SAMPLER": "always_off"}).sample_rate == 0.0
    assert not TracingConfig().with_env({"OTEL_TRACES_SAMPLER": "always_on"}).parent_based
    with pytest.raises(ConfigError):
        TracingConfig().with_env({"OTEL_TRACES_SAMPLER": "jaeger_remote"})
    with pytest.raises(ConfigError):
        TracingConfig(sample_rate=1.5).validate()


def test_traceparent_parsing() -> None:
    tp = traceparent(0xABC, 0xDEF, sampled=True)
    assert parse_traceparent(tp) == (0xABC, 0xDEF, True)
    assert parse_traceparent(traceparent(1, 2, sampled=False)) == (1, 2, False)
    for bad in (None, "", "00-xyz", "ff-" + tp[3:], tp.replace(f"{0xABC:032x}", "0" * 32), tp[:-3]):
        assert parse_traceparent(bad) is None, bad


def test_sampling_decisions() -> None:
    sink = SpanSink(TracingConfig(enabled=True), Nothing())
    try:
        t = Telemetry(TracingConfig(enabled=True, sample_rate=0.2), sink=sink, rng=random.Random(1))
        got = [t.begin("/v1/completions", {}) for _ in range(5000)]
        traced = sum(1 for r in got if r is not None and r.traced)
        assert 800 < traced < 1200  # 0.2 of 5000
        # A client's decision is followed, both ways.
        yes, no = traceparent(7, 8, True), traceparent(7, 8, False)
        assert all(t.begin("/", {"traceparent": yes}).traced for _ in range(50))  # type: ignore[union-attr]
        assert all(t.begin("/", {"traceparent": no}) is None for _ in range(50))
        # Logged but not traced: facts only, no spans kept.
        t2 = Telemetry(TracingConfig(enabled=True, sample_rate=0.0), AccessLogConfig(enabled=True), sink=sink)
        rec = t2.begin("/v1/completions", {})
        assert rec is not None and not rec.traced
        rec.phase("kvrouter.parse", 1, 2)
        assert rec.phases == []
    finally:
        sink.shutdown()
    assert Telemetry().begin("/v1/completions", {"traceparent": yes}) is None  # all off: nothing at all
