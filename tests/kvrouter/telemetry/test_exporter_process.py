"""Spans encoded and sent by the exporter's own process (``tracing.export_process``, the default): what a
real OTLP receiver gets is what the request recorded, a batch is whole requests within the batch size
(a request larger than it alone is split), a value of a str enum arrives as its string, and an exporter
process that died is started again (its batch in flight counted failed, never the request path's problem)."""

from __future__ import annotations

import asyncio
import enum
import functools
import os
import random
import signal

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from kvrouter.telemetry import Telemetry, TracingConfig
from kvrouter.telemetry.export import ExporterProcess
from tests.support.otlp import OtlpReceiver, otlp_receiver
from tests.support.wait import until

pytestmark = pytest.mark.asyncio


class Policy(enum.StrEnum):
    KV = "kv-aware"


def one(t: Telemetry, i: int) -> str:
    rec = t.begin("/v1/chat/completions", {})
    assert rec is not None and rec.traced
    n = rec.start_ns
    rec.phase("kvrouter.decision", n, n + 1000, {"kvrouter.policy": Policy.KV, "kvrouter.i": i, "x": 0.5})
    rec.upstream_started("whole", "w0", 1)
    rec.upstream_answered(200)
    rec.first_token()
    t.end(rec, 200)
    return rec.trace_hex


async def test_the_exporter_process_sends_what_was_recorded() -> None:
    async with otlp_receiver() as (rx, url):
        cfg = TracingConfig(enabled=True, sample_rate=1.0, endpoint=url, max_export_batch_size=7)
        assert cfg.export_process
        t = Telemetry(cfg, rng=random.Random(5))
        sink = t.sink
        assert sink is not None and isinstance(sink.shipper, ExporterProcess)
        loop = asyncio.get_running_loop()
        try:
            ids = [one(t, i) for i in range(6)]  # 6 requests x 6 spans
            assert await loop.run_in_executor(None, sink.force_flush)
            await until(lambda: len(rx.spans) >= 36, 20, "36 spans")
            assert (sink.sent, sink.failed, sink.dropped) == (36, 0, 0)
            assert rx.requests == 6  # 36 spans, at most 7 per export request
            for i, tid in enumerate(ids):
                spans = {s.name: s for s in rx.trace(tid)}
                assert set(spans) == {
                    "kvrouter.request",
                    "kvrouter.decision",
                    "kvrouter.upstream.whole",
                    "kvrouter.upstream_connect",
                    "kvrouter.first_token",
                    "kvrouter.completion",
                }
                dec, root = spans["kvrouter.decision"], spans["kvrouter.request"]
                assert dec.attrs == {"kvrouter.policy": "kv-aware", "kvrouter.i": i, "x": 0.5}
                assert dec.parent_id == root.span_id and root.parent_id == ""
                assert spans["kvrouter.first_token"].parent_id == spans["kvrouter.upstream.whole"].span_id
                assert root.attrs["http.response.status_code"] == 200

            # The exporter's process dies: the next batch starts a new one.
            proc = sink.shipper._proc
            assert proc is not None and sink.shipper.starts == 1
            os.kill(proc.pid, signal.SIGKILL)  # (started with the export thread, before any batch)
            await loop.run_in_executor(None, proc.wait)
            more = [one(t, 100 + i) for i in range(2)]
            assert await loop.run_in_executor(None, sink.force_flush)
            await until(lambda: all(len(rx.trace(x)) == 6 for x in more), 20, "the spans after the restart")
            assert sink.shipper.starts == 2 and (sink.sent, sink.failed) == (48, 0)
        finally:
            await loop.run_in_executor(None, t.shutdown)
        assert proc.poll() is not None
        assert sink.shipper._proc is None  # shut down: its input closed, it exited


def _received(rx: OtlpReceiver, spans: int) -> bool:
    return len(rx.spans) >= spans


def _posts(rx: OtlpReceiver) -> list[list[str]]:
    """Each export request's spans, by trace id."""
    out = []
    for body in rx.bodies:
        msg = ExportTraceServiceRequest.FromString(body)
        out.append([s.trace_id.hex() for rs in msg.resource_spans for ss in rs.scope_spans for s in ss.spans])
    return out


@pytest.mark.parametrize("process", [True, False])
async def test_a_batch_is_whole_requests_within_the_batch_size(process: bool) -> None:
    """Requests of 6 spans: with 20 a batch, each POST holds whole requests and at most 20 spans (3
    requests, where splitting at 20 would send 20, 20, 20 and a tail with requests cut in two); a request
    larger than the batch is the one thing split."""
    loop = asyncio.get_running_loop()
    for batch, n in ((20, 12), (4, 3)):
        async with otlp_receiver() as (rx, url):
            cfg = TracingConfig(
                enabled=True,
                sample_rate=1.0,
                endpoint=url,
                max_export_batch_size=batch,
                export_process=process,
            )
            t = Telemetry(cfg, rng=random.Random(batch))
            assert t.sink is not None
            try:
                ids = [one(t, i) for i in range(n)]
                assert await loop.run_in_executor(None, t.sink.force_flush)
                await until(functools.partial(_received, rx, 6 * n), 20, "every span")
            finally:
                await loop.run_in_executor(None, t.shutdown)
            posts = _posts(rx)
            assert sorted(x for p in posts for x in p) == sorted(x for x in ids for _ in range(6))
            assert all(len(p) <= batch for p in posts)
            if batch >= 6:
                # whole requests: a trace's spans in one POST
                assert all(sum(tid in p for p in posts) == 1 for tid in ids), posts
                assert len(posts) >= n * 6 // batch
            else:
                assert [len(p) for p in posts] == [4, 2] * n  # each request alone, in two
