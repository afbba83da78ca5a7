"""The gateway against sglang-router in front of the same fake workers, in the same run.

Every run uses ``shared/peerbench/router_bench.py`` (added latency, added time to the first streamed
chunk, requests/s at concurrency 32, prefix stickiness), so all figures come from one harness.  kvrouter
runs as ``kvrouter serve --workers W --front F`` for each W of ``--workers`` with the lean core, and once
with one worker and aiohttp in front (``kvrouter_aiohttp_w1``), with token parity checks off
(``fleet_overlay``) so that every prompt is tokenized, hashed and looked up behind the fake workers.

Each router's process tree is sampled here (``proctree.TreeSampler``): CPU of every process over the run
per request (``cpu_ms_per_req_run``, the same measure for sglang) and memory as PSS summed over the tree.

``profile`` (``gateway_profile``): one lean router's CPU per request, by category.  ``refusal``
(``refusal_bench``): CPU per refused request against CPU per served one (``--refusal-only``: that alone).
The method in full: docs/results.md, "How the benches measure".
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvrouter.lab.bench import refusal_bench
from kvrouter.lab.bench.common import peer_python, peerbench_dir
from kvrouter.lab.bench.proctree import TreeSampler
from tokenizer_cache import default_tokenizer_path

RATIO_KEYS = (
    "rps_small",
    "rps_big",
    "added_p50_small_ms",
    "added_p50_big_ms",
    "cpu_ms_per_req_run",
    "cpu_ms_per_req_small_harness",
    "cpu_ms_per_req_big_harness",
)


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--seq-n", type=int, default=600)
    ap.add_argument("--thr-n", type=int, default=1000)
    ap.add_argument("--thr-reps", type=int, default=2)
    ap.add_argument(
        "--workers", default="1,2,cores", help="kvrouter worker counts to run, comma-separated ('cores')"
    )
    ap.add_argument("--no-peer", action="store_true", help="skip sglang-router")
    ap.add_argument("--no-refusal", action="store_true", help="skip the refusal-cost part")
    ap.add_argument("--refusal-only", action="store_true", help="only the refusal-cost part")
    refusal_bench.add_args(ap)
    ap.add_argument("--no-aiohttp", action="store_true", help="skip the aiohttp-fronted kvrouter run")
    ap.add_argument("--no-profile", action="store_true", help="skip the profile of the lean core")
    ap.add_argument("--profile-n", type=int, default=5000, help="requests per shape in the profile")
    ap.add_argument(
        "--tracing-ab",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="CPU per request of tracing, A/B in running routers: ROUNDS rounds of a phase each on a router "
        "with tracing off, and on a router with tracing on without and with a sampled traceparent",
    )
    ap.add_argument("--tracing-ab-requests", type=int, default=800, help="requests per phase")
    ap.add_argument(
        "--tracing",
        type=int,
        default=0,
        metavar="REPS",
        help="also run one worker REPS times each with tracing off, on but not sampled, and every request "
        "sampled (spans exported to an OTLP receiver here), interleaved: the CPU tracing adds per request",
    )
    ap.add_argument(
        "--baseline-src",
        default=None,
        help="also run the kvrouter whose source tree is here (one process: e.g. `git archive` of an older "
        "commit), as kvrouter_baseline",
    )


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b in (None, 0) else round(a / b, 3)


def worker_counts(spec: str) -> list[int]:
    cores = len(os.sched_getaffinity(0))
    out: list[int] = []
    for w in spec.split(","):
        n = cores if w.strip() == "cores" else int(w)
        if n not in out:
            out.append(n)
    return out


def free_ports(offsets: range | tuple[int, ...]) -> int:
    """A port ``base`` such that every ``base + offset`` is free on 127.0.0.1 now (other engineers'
    benchmarks run on this machine too: the harness's default ports may be taken)."""
    for _ in range(200):
        base = random.randrange(20000, 60000 - max(offsets))
        socks = []
        try:
            for p in (base + o for o in offsets):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


def requests_sent(params: dict[str, Any]) -> int:
    """Requests the harness sends its router in one run (readiness pings aside): warm-up, stickiness,
    sequential blocks, throughput reps (each with its warm-up)."""
    seq = 3 * (params["seq_n"] // params["blocks"]) * params["blocks"]
    sticky = 2 * params["groups"] * params["per_group"]
    thr = params["thr_reps"] * 2 * (min(200, params["thr_n"]) + params["thr_n"])
    return 200 + sticky + seq + thr


def run_sampled(cmd: list[str], marker: str, ready_url: str, processes: int) -> dict[str, Any] | None:
    """One harness run, the router's process tree sampled meanwhile."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sampler = TreeSampler(proc.pid, marker, ready_url=ready_url, processes=processes)
    sampler.start()
    try:
        out, err = proc.communicate(timeout=1800)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    tree = sampler.stop()
    try:
        res: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        print(f"peer benchmark unavailable: {err[-2000:]}", file=sys.stderr)
        return None
    n = requests_sent(res["params"])
    tree["requests"] = n
    tree["cpu_ms_per_req_run"] = round(tree["cpu_s"] * 1e3 / n, 3) if tree["cpu_s"] else None
    res["tree"] = tree
    return res


def _g(r: dict[str, Any] | None, *path: str) -> float | None:
    v: Any = r
    for p in path:
        v = v.get(p) if isinstance(v, dict) else None
    return v if isinstance(v, int | float) else None


def summary(r: dict[str, Any] | None) -> dict[str, Any]:
    """The figures docs/results.md shows, from one harness run."""
    one = _g(r, "tree", "processes") == 1
    return {
        "rps_small": _g(r, "throughput", "router_small", "rps"),
        "rps_big": _g(r, "throughput", "router_big", "rps"),
        "added_p50_small_ms": _g(r, "sequential", "added_small", "p50_ms"),
        "added_p50_big_ms": _g(r, "sequential", "added_big", "p50_ms"),
        "added_first_chunk_ms": _ttfb_added(r or {}),
        # The harness reads the process it started: a supervisor's workers are not in it.
        "cpu_ms_per_req_small_harness": _g(r, "throughput", "router_small", "router_cpu_ms_per_req")
        if one
        else None,
        "cpu_ms_per_req_big_harness": _g(r, "throughput", "router_big", "router_cpu_ms_per_req")
        if one
        else None,
        "cpu_ms_per_req_run": _g(r, "tree", "cpu_ms_per_req_run"),
        "pss_mb_end": _g(r, "tree", "pss_mb_end"),
        "pss_mb_median": _g(r, "tree", "pss_mb_median"),
        "rss_sum_mb_end": _g(r, "tree", "rss_sum_mb_end"),
        "tree_mb_end": _g(r, "tree", "tree_mb_end"),
        "processes": _g(r, "tree", "processes"),
    }


def main(a: argparse.Namespace) -> dict[str, Any]:
    if a.refusal_only:
        return {"refusal": refusal_bench.main(a)}
    out = harness_runs(a)
    if a.tracing_ab:
        out["tracing_ab"] = tracing_ab_run(a)
    if not a.no_refusal:
        out["refusal"] = refusal_bench.main(a)
    return out


def tracing_ab_run(a: argparse.Namespace) -> dict[str, Any]:
    """The tracing A/B: peerbench's fake workers, on its venv's interpreter when there is one (it needs
    only aiohttp, so this interpreter otherwise: the A/B does not need the peers' venvs)."""
    from .tracing_ab import tracing_ab

    d, py = peerbench_dir(), peer_python("bench")
    if d is None:
        return {"skipped": "shared/peerbench missing (PEERBENCH_DIR)"}
    return tracing_ab(
        a.tracing_ab, a.tracing_ab_requests, py or Path(sys.executable), Path(d) / "fakeworker.py"
    )


def harness_runs(a: argparse.Namespace) -> dict[str, Any]:
    """Every router through the peer harness (kvrouter at each worker count, sglang-router)."""
    d, py = peerbench_dir(), peer_python("bench")
    if d is None or py is None:
        return {
            "skipped": "shared/peerbench or its venvs ($PEER_VENVS, see shared/peerbench/setup.sh) missing"
        }
    common = ["--seq-n", str(a.seq_n), "--thr-n", str(a.thr_n), "--thr-reps", str(a.thr_reps)]
    os.environ["PEERBENCH_TOKENIZER"] = default_tokenizer_path()
    harness = [str(py), str(Path(d) / "router_bench.py")]
    ports = free_ports(range(4))  # the fake workers
    common += ["--worker-base-port", str(ports)]
    out: dict[str, Any] = {"runs": {}}
    kv_runs = [(f"kvrouter_w{w}", w, "lean") for w in worker_counts(a.workers)]
    if not a.no_aiohttp:
        kv_runs.append(("kvrouter_aiohttp_w1", 1, "aiohttp"))
    for name, w, front in kv_runs:
        kv_cmd = (
            f"{sys.executable} -m kvrouter.lab.bench.fleet_overlay {{fleet}} parity.enabled=false --"
            f" --log-level WARNING serve --fleet @fleet --port {{port}} --workers {w} --front {front}"
        )
        port = free_ports((0, 1000))  # the router and its prometheus port (+1000, sglang's)
        out["runs"][name] = run_sampled(
            [*harness, "--router", "custom", "--router-cmd", kv_cmd, *common, "--router-port", str(port)],
            "kvrouter.cli",
            f"http://127.0.0.1:{port}/livez",
            w + (w > 1),
        )
    if a.baseline_src:
        port = free_ports((0, 1000))
        # Run from the baseline tree (``-m`` puts the working directory first on the path: from here it
        # would import this tree's kvrouter)
        src = Path(a.baseline_src).resolve()
        cmd = f"env -C {src} PYTHONPATH={src} {sys.executable} -m kvrouter.cli"
        cmd += " --log-level WARNING serve --fleet {fleet} --port {port}"
        out["runs"]["kvrouter_baseline"] = run_sampled(
            [*harness, "--router", "custom", "--router-cmd", cmd, *common, "--router-port", str(port)],
            "kvrouter.cli",
            f"http://127.0.0.1:{port}/livez",
            1,
        )
    if a.tracing:
        out["tracing"] = tracing_runs(a.tracing, harness, common)
    if not a.no_peer:
        port = free_ports((0, 1000))
        out["runs"]["sglang"] = run_sampled(
            [*harness, "--router", "sglang", "--policy", "cache_aware", *common, "--router-port", str(port)],
            "sglang_router",
            f"http://127.0.0.1:{port}/health",
            1,
        )
    out["summary"] = {name: summary(r) for name, r in out["runs"].items()}
    if not a.no_profile:
        from kvrouter.lab.bench.gateway_profile import profile

        out["profile"] = profile("lean", n=a.profile_n)
    s = out["summary"].get("sglang")
    if s and s["rps_small"]:
        out["ratios_over_sglang"] = {
            name: {k: _ratio(v.get(k), s.get(k)) for k in RATIO_KEYS}
            for name, v in out["summary"].items()
            if name != "sglang"
        }
    out["targets"] = targets(out)
    return out


TRACING_MODES = {
    "off": {},
    "unsampled": {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_TRACES_SAMPLER": "traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0",
    },
    "sampled": {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_TRACES_SAMPLER": "always_on"},
}
"""How each tracing run's router is configured (the standard variables, as an operator would)."""


TRACING_MEASURES = {
    "run": ("tree", "cpu_ms_per_req_run"),
    "sequential": ("sequential", "router_cpu_ms_per_req_seq"),
    "small_32": ("throughput", "router_small", "router_cpu_ms_per_req"),
    "big_32": ("throughput", "router_big", "router_cpu_ms_per_req"),
}
"""CPU per request as the harness and the tree sampler read it: over the whole run (every process of the
tree, background work included), the sequential phase, and the 32-concurrent phases (small, 9 KB)."""


def tracing_runs(reps: int, harness: list[str], common: list[str]) -> dict[str, Any]:
    """One worker with tracing off, on and unsampled, on and sampled, ``reps`` times each in turn: CPU per
    request by each measure; the medians, and the median over reps of each mode's difference from the
    tracing-off run of the same rep (paired: the machine's load drifts between reps), in microseconds."""
    import statistics

    from .otlp_sink import OtlpSink

    sink = OtlpSink()
    endpoint = sink.start()
    cpu: dict[str, dict[str, list[float | None]]] = {
        m: {k: [] for k in TRACING_MEASURES} for m in TRACING_MODES
    }
    sent: dict[str, int] = dict.fromkeys(TRACING_MODES, 0)
    try:
        for _ in range(reps):
            for mode, env in TRACING_MODES.items():
                port = free_ports((0, 1000))
                env = {**env, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint} if env else env
                prefix = "env " + " ".join(f"{k}={v}" for k, v in env.items()) + " " if env else ""
                cmd = f"{prefix}{sys.executable} -m kvrouter.cli --log-level WARNING serve --fleet {{fleet}}"
                cmd += " --port {port} --workers 1"
                r = run_sampled(
                    [
                        *harness,
                        "--router",
                        "custom",
                        "--router-cmd",
                        cmd,
                        *common,
                        "--router-port",
                        str(port),
                    ],
                    "kvrouter.cli",
                    f"http://127.0.0.1:{port}/livez",
                    1,
                )
                for k, path in TRACING_MEASURES.items():
                    cpu[mode][k].append(_g(r, *path))
                sent[mode] += int(_g(r, "tree", "requests") or 0)
    finally:
        sink.stop()

    def med(v: list[float | None]) -> float | None:
        got = [x for x in v if x is not None]
        return round(statistics.median(got), 4) if got else None

    added: dict[str, dict[str, float | None]] = {}
    for mode in ("unsampled", "sampled"):
        added[mode] = {}
        for k in TRACING_MEASURES:
            pairs = [
                (a - b) * 1e3
                for a, b in zip(cpu[mode][k], cpu["off"][k], strict=True)
                if a is not None and b is not None
            ]
            added[mode][k] = round(statistics.median(pairs), 1) if pairs else None
    return {
        "cpu_ms_per_req": cpu,
        "median_cpu_ms_per_req": {m: {k: med(v) for k, v in by.items()} for m, by in cpu.items()},
        "added_cpu_us_per_req_paired_median": added,
        "spans_received": sink.spans,
        "requests_sampled_runs": sent["sampled"],
    }


def targets(out: dict[str, Any]) -> dict[str, Any]:
    """Issue 34's targets, each with its figure from this run: CPU per request of one lean worker (the
    harness's 32-concurrent phase), and, at the machine's cores (sglang-router's threads use them all),
    requests/s and added p50 over sglang-router's, and the first streamed chunk's time over direct."""
    cores = len(os.sched_getaffinity(0))
    s = out["summary"]
    one, eq, peer = s.get("kvrouter_w1") or {}, s.get(f"kvrouter_w{cores}") or {}, s.get("sglang") or {}

    def check(value: float | None, limit: float, below: bool = True) -> dict[str, Any]:
        met = None if value is None else (value <= limit if below else value >= limit)
        return {"value": value, "limit": limit, "met": met}

    return {
        "cpu_ms_per_req_small_w1": check(one.get("cpu_ms_per_req_small_harness"), 0.25),
        "cpu_ms_per_req_big_w1": check(one.get("cpu_ms_per_req_big_harness"), 0.35),
        f"rps_small_over_sglang_w{cores}": check(
            _ratio(eq.get("rps_small"), peer.get("rps_small")), 1.0, False
        ),
        f"rps_big_over_sglang_w{cores}": check(_ratio(eq.get("rps_big"), peer.get("rps_big")), 1.0, False),
        f"added_p50_small_over_sglang_w{cores}": check(
            _ratio(eq.get("added_p50_small_ms"), peer.get("added_p50_small_ms")), 1.0
        ),
        f"added_p50_big_over_sglang_w{cores}": check(
            _ratio(eq.get("added_p50_big_ms"), peer.get("added_p50_big_ms")), 1.0
        ),
        f"added_first_chunk_ms_w{cores}": check(eq.get("added_first_chunk_ms"), 1.0),
    }


def _ttfb_added(r: dict[str, Any]) -> float | None:
    seq = r.get("sequential", {})
    routed, direct = seq.get("router_chat_stream_ttfb"), seq.get("direct_chat_stream_ttfb")
    if not routed or not direct:
        return None
    return round(routed["p50_ms"] - direct["p50_ms"], 3)


if __name__ == "__main__":  # ``python -m kvrouter.lab.bench.gateway_bench --workers 1,2 ...``: other settings
    ap = argparse.ArgumentParser()
    add_args(ap)
    print(json.dumps(main(ap.parse_args()), indent=1))
