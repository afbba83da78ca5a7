"""CPU per request of the telemetry hooks alone, in one process (``kvrouter bench gateway --tracing``
measures the whole router, where the machine's noise is larger than these figures).

    .venv/bin/python tools/tracing_cost.py [--requests 5000]

One request's record as the pipeline makes it (parse, tokenize, index lookup, decision, an upstream
attempt with its connect, first token and completion; the facts of the access log), ended and, when
traced, queued for export: the request path alone (this thread's CPU), encoded (every thread of this
process), and sent to an OTLP/HTTP receiver in this process (its decoding counts here too, so the
exported figures are upper bounds) from the export thread or from the exporter's own process (its CPU
added).  JSON on stdout.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from typing import Any

from kvrouter.lab.bench.otlp_sink import OtlpSink
from kvrouter.telemetry import Telemetry, TracingConfig
from kvrouter.telemetry.export import SpanSink


class _Discard:
    def send(self, payload: bytes) -> bool:
        return True

    def shutdown(self) -> None:
        pass


def one(tel: Telemetry, headers: dict[str, str]) -> None:
    rec = tel.begin("/v1/chat/completions", headers)
    if rec is None:
        return
    n = time.time_ns()
    rec.phase("kvrouter.parse", n, n + 10, {"kvrouter.kind": "chat", "kvrouter.body_bytes": 9000})
    rec.facts.update(model="m", tenant=None)
    rec.phase(
        "kvrouter.tokenize",
        n,
        n + 10,
        {
            "kvrouter.tokens": 1900,
            "kvrouter.tokenizer_cache": "hit",
            "kvrouter.tokenizer_cache.reused_tokens": 1800,
        },
    )
    rec.facts.update(request_id="w0-r1", prompt_tokens=1900)
    look: dict[str, Any] = {
        "kvrouter.candidates": 4,
        "kvrouter.matched_blocks": 112,
        "kvrouter.matched_target": "vllm-0",
    }
    look.update({"kvrouter.matched_blocks.GPU": 100, "kvrouter.matched_blocks.speculative": 12})
    rec.phase("kvrouter.index_lookup", n, n + 10, look)
    dec: dict[str, Any] = {
        "kvrouter.policy": "kv-aware",
        "kvrouter.reason": "cache",
        "kvrouter.chosen": "vllm-0",
    }
    dec.update(
        {
            "kvrouter.chosen.score": 812.5,
            "kvrouter.chosen.cached_tokens": 1792,
            "kvrouter.chosen.in_flight": 3,
        }
    )
    dec.update({"kvrouter.chosen.blocks.GPU": 100, "kvrouter.chosen.blocks.speculative": 12})
    dec.update(
        {
            "kvrouter.runner_up": "vllm-1",
            "kvrouter.runner_up.score": 15420.0,
            "kvrouter.runner_up.cached_tokens": 0,
        }
    )
    rec.phase("kvrouter.decision", n, n + 10, dec)
    rec.facts.update(policy="kv-aware", reason="cache", predicted_cached_tokens=1792, queue_wait_ms=0.0)
    rec.facts.update(instance="vllm-0", attempts=1)
    rec.upstream_started("whole", "vllm-0", 1)
    rec.upstream_headers()
    rec.upstream_answered(200)
    rec.first_token()
    rec.facts["reported_cached_tokens"] = 1792
    usage = {"gen_ai.usage.input_tokens": 1900, "gen_ai.usage.output_tokens": 16}
    rec.upstream_ended(**usage, **{"kvrouter.reported_cached_tokens": 1792})
    tel.end(rec, 200)


def cost(
    tel: Telemetry, n: int, headers: dict[str, str] | None = None, clock: Any = time.process_time
) -> float:
    h = headers or {}
    for _ in range(200):
        one(tel, h)
    t = clock()
    for _ in range(n):
        one(tel, h)
    return round((clock() - t) / n * 1e6, 2)


def exported(
    a: argparse.Namespace, sink: OtlpSink, endpoint: str, process: bool, out: dict[str, Any]
) -> float:
    """CPU per request, recorded to received: this process's threads and (``process``) the exporter's
    process, whose CPU is read once it exited (``RUSAGE_CHILDREN``), less its start-up."""
    cfg = TracingConfig(
        enabled=True, sample_rate=1.0, endpoint=endpoint, max_queue_size=1 << 20, export_process=process
    )
    start = 0.0
    if process:  # the process's start-up (imports), once per router worker: measured alone, taken off
        k0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        idle = Telemetry(cfg)
        assert idle.sink is not None
        idle.sink.force_flush()
        idle.shutdown()
        k1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = (k1.ru_utime + k1.ru_stime) - (k0.ru_utime + k0.ru_stime)
        out["exporter_process_start_cpu_ms"] = round(start * 1e3, 1)
    tel = Telemetry(cfg)
    assert tel.sink is not None
    before = sink.spans
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.process_time()
    for _ in range(a.requests):
        one(tel, {})
    tel.sink.force_flush()
    tel.shutdown()
    k = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = time.process_time() - t + (k.ru_utime + k.ru_stime) - (kids.ru_utime + kids.ru_stime) - start
    assert sink.spans - before == 9 * a.requests, (sink.spans, before)  # 9 spans a request
    return round(total / a.requests * 1e6, 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=5000)
    a = ap.parse_args()
    on = TracingConfig(enabled=True, max_queue_size=1 << 20)
    discard = SpanSink(on, _Discard())
    out: dict[str, Any] = {"requests": a.requests}
    out["off_us"] = cost(Telemetry(), a.requests)
    out["unsampled_us"] = cost(
        Telemetry(TracingConfig(enabled=True, sample_rate=0.0), sink=discard), a.requests
    )
    sampled = Telemetry(TracingConfig(enabled=True, sample_rate=1.0), sink=discard)
    out["sampled_request_path_us"] = cost(sampled, a.requests, clock=time.thread_time)
    t = time.process_time()
    cost(sampled, a.requests)
    discard.force_flush()
    out["sampled_encoded_us"] = round((time.process_time() - t) / (a.requests + 200) * 1e6, 2)
    sink = OtlpSink()
    endpoint = sink.start()
    out["sampled_exported_thread_us"] = exported(a, sink, endpoint, False, out)
    out["sampled_exported_process_us"] = exported(a, sink, endpoint, True, out)
    sink.stop()
    discard.shutdown()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
