"""How the workers of ``kvrouter serve --workers N`` should make one /metrics: prometheus_client's
multiprocess mode against the host's shared memory (``kvrouter.host.metric_merge``), measured.

    .venv/bin/python tools/metrics_modes.py [--requests 20000] [--workers 2] [--targets 8]

For each mode, in a process of its own (multiprocess mode is chosen when prometheus_client is imported):
CPU per request of the metric updates one routed request makes in the gateway (the same families,
labels and calls), and CPU per scrape of the host's exposition with ``--workers`` workers' worth of
series.  JSON on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def request_updates(m, target: str, i: int) -> None:
    """What one routed, streamed request records (``pipeline`` + ``proxy``)."""
    p = m.pipeline
    p.decisions.labels("kv-aware", "cache").inc()
    p.decision_seconds.observe(0.0004)
    p.prompt_tokens.inc(900)
    p.predicted_cached.labels(target).inc(512)
    p.routed_blocks.labels("GPU").inc(32)
    p.routed_credit.labels("GPU").inc(32.0)
    p.shadow_cached.labels("kv-aware").inc(512)
    for name in ("prefix-hash", "least-loaded", "round-robin", "random"):
        p.shadow_cached.labels(name).inc(256)
        if i % 2:
            p.shadow_agree.labels(name).inc()
    m.upstream_ttft.labels(target).observe(0.03)
    p.reported_cached.labels(target).inc(512)
    p.cached_error.observe(0)
    m.requests.labels("/v1/chat/completions", "200").inc()


def child(mode: str, requests: int, workers: int, targets: int) -> dict[str, float]:
    if mode == "multiprocess":
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="kvr-mp-")
    from prometheus_client import CollectorRegistry
    from prometheus_client.exposition import generate_latest

    from kvrouter.gateway.metrics import GatewayMetrics

    names = [f"vllm-{k}" for k in range(targets)]
    # Per request: one worker's updates.
    m = GatewayMetrics()
    for i in range(2000):
        request_updates(m, names[i % targets], i)
    t = time.process_time()
    for i in range(requests):
        request_updates(m, names[i % targets], i)
    per_request_us = (time.process_time() - t) / requests * 1e6

    # Per scrape: every worker's series, as the host shows them.
    if mode == "multiprocess":
        from prometheus_client import multiprocess

        # Other workers' files: the same series written by other pids (values are per-pid files).
        for w in range(1, workers):
            pid = os.fork()
            if pid == 0:
                from prometheus_client import values

                values.ValueClass = values.MultiProcessValue(lambda w=w: 10_000 + w)
                mw = GatewayMetrics()
                for i in range(500):
                    request_updates(mw, names[i % targets], i)
                os._exit(0)
            os.waitpid(pid, 0)
        reg = CollectorRegistry()
        multiprocess.MultiProcessCollector(reg)

        def scrape() -> bytes:
            return generate_latest(reg)

    else:
        from kvrouter.host.metric_merge import Merged, decode, encode, merge, snapshot

        others = []
        for w in range(1, workers):
            mw = GatewayMetrics()
            for i in range(500):
                request_updates(mw, names[i % targets], i)
            others.append(encode(snapshot(w, mw.registry.collect())))

        def scrape() -> bytes:
            # The scraped worker's own snapshot (encoded: it is published for a crash), the others'
            # rows read back, the merge and the exposition; the other workers' own snapshot CPU too.
            own = snapshot(0, m.registry.collect())
            blob = encode(own)
            for _ in others:
                encode(snapshot(1, m.registry.collect()))
            snaps = [decode(blob), *(decode(b) for b in others)]
            return generate_latest(Merged(merge(snaps, 0)))  # type: ignore[arg-type]

    for _ in range(5):
        scrape()
    n = 200
    t = time.process_time()
    for _ in range(n):
        body = scrape()
    per_scrape_ms = (time.process_time() - t) / n * 1e3
    return {
        "cpu_us_per_request": round(per_request_us, 2),
        "cpu_ms_per_scrape": round(per_scrape_ms, 3),
        "exposition_bytes": len(body),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--targets", type=int, default=8)
    ap.add_argument("--child", default=None)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.requests, a.workers, a.targets)))
        return
    out = {"params": vars(a) | {"child": None}}
    for mode in ("in-process (shared-memory merge)", "multiprocess"):
        key = "multiprocess" if mode == "multiprocess" else "shared"
        cmd = [sys.executable, __file__, "--child", key, "--requests", str(a.requests)]
        cmd += ["--workers", str(a.workers), "--targets", str(a.targets)]
        r = subprocess.run(cmd, capture_output=True, text=True, check=True)
        out[mode] = json.loads(r.stdout.strip().splitlines()[-1])
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
