"""Where a routed request's CPU goes in the gateway: a sampled profile under the harness's load.

One router process (``kvrouter serve --workers 1``) in front of peerbench's fake workers, under the
harness's request shapes (``router_bench.py``: a short and a long completions prompt, ``max_tokens`` 8,
32 in flight) and a fleet file like the harness's (the fleet's tokenizer, kv-aware, parity checks off),
as ``gateway_bench`` runs it: every prompt tokenized, hashed and looked up.

CPU per request is the router's ``/proc`` CPU over each measured phase (user and system).  The profile
is ``cpu_sampler``'s CPU-time samples of the measured phases, each put in the first category one of its
frames matches (``CATEGORIES`` anywhere in the stack, then ``LEAF_RULES`` from the leaf up); ``on_cpu`` is
perf's view of the same process by shared object, when perf runs here.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import random
import shutil
import signal
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvrouter.lab.bench.common import peer_python, peerbench_dir
from kvrouter.lab.bench.proctree import CLK

CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    # (category, substrings of "function (path:line)"), matched from the leaf frame up; stack-wide rules
    # first (a sample anywhere under shadow scoring or metrics is theirs, whatever runs at its leaf)
    ("shadow scoring", ("_record_shadow ", "shadow (kvrouter/routing")),
    ("metrics", ("prometheus_client/", "kvrouter/pipeline/metrics.py", "kvrouter/gateway/metrics.py")),
    ("logging", ("logging/__init__.py",)),
)
LEAF_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "tokenization",
        ("tokenizer_cache/", "tokenizers/", "kvrouter/pipeline/fleet_tokens.py", "transformers/"),
    ),
    ("block hashing", ("indexer/hashing", "indexer/kernels")),
    ("routing decision", ("kvrouter/routing/", "kvrouter/host/", "indexer/")),
    (
        "request parsing",
        ("kvrouter/api/requests.py", "kvrouter/api/fields.py", "kvrouter/api/parsed.py", "msgspec"),
    ),
    ("usage watching", ("kvrouter/api/usage.py",)),
    ("upstream client", ("kvrouter/gateway/upstream_http.py", "aiohttp/client", "aiohttp/connector")),
    ("lean server", ("kvrouter/gateway/lean/",)),
    (
        "aiohttp server",
        (
            "aiohttp/web_",
            "aiohttp/http_",
            "aiohttp/streams.py",
            "aiohttp/base_protocol",
            "aiohttp/payload",
            "multidict",
            "yarl/",
        ),
    ),
    ("pipeline and proxy glue", ("kvrouter/",)),
    ("event loop", ("asyncio/", "uvloop/", "run_app (", "run_forever (", "run_until_complete (")),
)


def categorize(stack: list[str]) -> str:
    """The category of one sample (frames root first)."""
    for name, keys in CATEGORIES:
        if any(k in f for f in stack for k in keys):
            return name
    for frame in reversed(stack):
        for name, keys in LEAF_RULES:
            if any(k in frame for k in keys):
                return name
    return "other"


def _short(frame: str) -> str:
    """``func (path:line)`` with the path from its package on (site-packages or this checkout)."""
    for cut in ("site-packages/", "/i34/", "/python3.11/"):
        i = frame.find(cut)
        if i >= 0:
            j = frame.rfind("(", 0, i)
            return frame[: j + 1] + frame[i + len(cut) :]
    return frame


def summarize(raw: str, cpu_ms_per_req: float | None, top: int = 12) -> dict[str, Any]:
    """Categories (share of samples, and the CPU per request that share stands for) and the leaf frames
    that took the most samples, from py-spy's raw (collapsed) output."""
    cats: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.splitlines():
        stack_s, _, n_s = line.rpartition(" ")
        if not stack_s or not n_s.isdigit():
            continue
        n = int(n_s)
        stack = [_short(f) for f in stack_s.split(";")]
        cats[categorize(stack)] += n
        leaves[stack[-1]] += n
        total += n
    if not total:
        return {"samples": 0}

    def us(n: int) -> float | None:
        return None if cpu_ms_per_req is None else round(n / total * cpu_ms_per_req * 1e3, 1)

    return {
        "samples": total,
        "categories": {k: {"share": round(n / total, 3), "us_per_req": us(n)} for k, n in cats.most_common()},
        "top_leaves": {k: round(n / total, 3) for k, n in leaves.most_common(top)},
    }


def _perf_dsos(perf: str, path: str) -> dict[str, float] | None:
    """On-CPU samples by shared object (the kernel, the interpreter, tokenizers, uvloop...): where the
    CPU itself went, without py-spy's wall-time bias (a thread waiting for a core inside a syscall)."""
    try:
        out = subprocess.run(
            [perf, "report", "-i", path, "--sort", "dso", "--stdio", "--percent-limit", "0.5"],
            capture_output=True,
            text=True,
            timeout=300,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
    shares: dict[str, float] = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0].endswith("%") and not line.startswith("#"):
            dso = parts[-1].rsplit("/", 1)[-1]
            shares[dso] = round(shares.get(dso, 0.0) + float(parts[0][:-1]) / 100, 3)
    return shares


def _words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 9))) for _ in range(n))


async def _phase(base: str, path: str, make: Any, n: int, conc: int, pid: int) -> dict[str, Any]:
    """``n`` requests of one shape, ``conc`` in flight, after a warm-up; the router sampled meanwhile."""
    import aiohttp

    errors = 0
    sem = asyncio.Semaphore(conc)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=conc)) as s:

        async def one(i: int) -> None:
            nonlocal errors
            async with sem, s.post(base + path, json=make(i)) as r:
                await r.read()
                errors += r.status != 200

        await asyncio.gather(*(one(i) for i in range(min(n, 200))))  # warm connections and caches
        os.kill(pid, signal.SIGUSR1)  # the sampler samples the measured phase only
        (u0, s0), t0 = _user_sys(pid), time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        (u1, s1), t1 = _user_sys(pid), time.perf_counter()
        os.kill(pid, signal.SIGUSR2)
    return {
        "cpu_ms_per_req": round((u1 - u0 + s1 - s0) * 1e3 / n, 3),
        "sys_ms_per_req": round((s1 - s0) * 1e3 / n, 3),
        "rps": round(n / (t1 - t0), 1),
        "errors": errors,
    }


async def _load(base: str, shapes: dict[str, Any], n: int, conc: int, pid: int) -> dict[str, Any]:
    return {name: await _phase(base, path, make, n, conc, pid) for name, (path, make) in shapes.items()}


def _user_sys(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of ``pid``."""
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return int(parts[11]) / CLK, int(parts[12]) / CLK


def _fleet(ports: list[int], front: str) -> str:
    from tokenizer_cache import default_tokenizer_path

    text = f"block_size: 16\ntokenizer: {default_tokenizer_path()}\nparity:\n  enabled: false\n"
    text += f"gateway:\n  front: {front}\ninstances:\n"
    text += "".join(f"  - name: w{i}\n    url: http://127.0.0.1:{p}\n" for i, p in enumerate(ports))
    fd, path = tempfile.mkstemp(suffix=".yaml")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def _wait(url: str, timeout: float = 120) -> bool:
    import urllib.request

    end = time.time() + timeout
    while time.time() < end:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            time.sleep(0.3)
    return False


def profile(
    front: str, *, n: int = 5000, conc: int = 32, seed: int = 7, shapes: tuple[str, ...] = ("small", "big")
) -> dict[str, Any]:
    """Run the router with ``front`` under load of ``shapes``, profiled; see the module docstring."""
    from kvrouter.lab.bench.gateway_bench import free_ports

    d, py = peerbench_dir(), peer_python("bench")
    if d is None or py is None:
        return {"skipped": "shared/peerbench or its venvs missing"}
    wport = free_ports(range(4))
    ports = [wport + i for i in range(4)]
    rport = free_ports((0,))
    fleet = _fleet(ports, front)
    rng = random.Random(seed)
    small = "Hello, how are you today? " * 4
    big = _words(rng, 1500)
    every = {
        "small": (
            "/v1/completions",
            lambda i: {"model": "fake-model", "prompt": f"{i} " + small, "max_tokens": 8},
        ),
        "big": (
            "/v1/completions",
            lambda i: {"model": "fake-model", "prompt": big + f" {i}", "max_tokens": 8},
        ),
    }
    procs: list[subprocess.Popen[bytes]] = []
    try:
        fake_workers = subprocess.Popen(
            [str(py), str(Path(d) / "fakeworker.py"), "--ports", *map(str, ports)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        procs.append(fake_workers)
        if not all(_wait(f"http://127.0.0.1:{p}/health") for p in ports):
            return {"skipped": "the fake workers did not start"}
        raw_path = tempfile.mktemp(suffix=".txt")
        cmd = [sys.executable, "-m", "kvrouter.lab.bench.cpu_sampler", raw_path, "--log-level", "WARNING"]
        router = subprocess.Popen(
            [*cmd, "serve", "--fleet", fleet, "--port", str(rport), "--workers", "1"],
            stdout=subprocess.DEVNULL,
        )
        procs.append(router)
        base = f"http://127.0.0.1:{rport}"
        if not _wait(base + "/livez"):
            return {"skipped": "the router did not start"}
        perf_path = tempfile.mktemp(suffix=".data")
        perf = shutil.which("perf")
        perf_p = (
            subprocess.Popen(
                [perf, "record", "-e", "cpu-clock", "-F", "999", "-p", str(router.pid), "-o", perf_path],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            if perf
            else None
        )
        try:
            phases = asyncio.run(_load(base, {k: every[k] for k in shapes}, n, conc, router.pid))
        finally:
            if perf_p is not None:
                perf_p.send_signal(signal.SIGINT)
                perf_p.wait(timeout=60)
            router.terminate()  # the sampler writes its stacks as the router exits
            router.wait(timeout=60)
        raw = Path(raw_path).read_text() if Path(raw_path).exists() else ""
        on_cpu = _perf_dsos(perf, perf_path) if perf else None
        cpus = [p["cpu_ms_per_req"] for p in phases.values() if p["cpu_ms_per_req"] is not None]
        mean_cpu = sum(cpus) / len(cpus) if cpus else None
        prof = summarize(raw, mean_cpu)
        prof["raw"] = raw_path
        return {"front": front, "phases": phases, "profile": prof, "on_cpu": on_cpu}
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        os.unlink(fleet)


if __name__ == "__main__":  # ``python -m kvrouter.lab.bench.gateway_profile [--shapes small] [front ...]``
    import argparse
    import json

    ap = argparse.ArgumentParser()
    ap.add_argument("fronts", nargs="*", default=["lean"])
    ap.add_argument("--shapes", default="small,big")
    ap.add_argument("--n", type=int, default=5000)
    a = ap.parse_args()
    shapes = tuple(a.shapes.split(","))
    print(json.dumps({f: profile(f, n=a.n, shapes=shapes) for f in a.fronts}, indent=1))
