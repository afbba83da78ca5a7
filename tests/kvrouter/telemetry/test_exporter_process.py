"""Spans encoded and sent by the exporter's own process (``tracing.export_process``, the default): what a
real OTLP receiver gets is what the request recorded, batches are split at the batch size, a value
msgpack carries as its value (a str enum) still arrives, and an exporter process that died is
started again (its batch in flight counted failed, never the request path's problem)."""

from __future__ import annotations

import asyncio
import enum
import os
import random
import signal

import pytest

from kvrouter.telemetry import Telemetry, TracingConfig
from kvrouter.telemetry.export import ExporterProcess
from tests.support.otlp import otlp_receiver
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
