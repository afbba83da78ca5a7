"""``kvrouter serve`` / ``kvrouter check`` as processes in front of real vLLM servers (tests/real), and the
request helpers that read what the router predicted and what vLLM reported."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import yaml

from kvrouter.api.usage import read_usage
from tests.support.net import free_port
from tests.support.real_vllm import BLOCK_SIZE, RealVllm, models_dir

ROOT = Path(__file__).resolve().parents[2]


def fleet_file(path: Path, servers: list[RealVllm], *, urls_only: bool = True, **over: Any) -> Path:
    """A fleet file naming each server by URL only (events from ``/kv_event_sources``), or with its event
    endpoints as seen from here (``urls_only=False``: what a user would write for a wildcard endpoint)."""
    insts: list[dict[str, Any]] = []
    for s in servers:
        inst: dict[str, Any] = {"name": s.spec.name, "url": s.spec.url}
        if not urls_only:
            inst["events"] = f"tcp://127.0.0.1:{s.spec.events_port}"
            inst["replay"] = f"tcp://127.0.0.1:{s.spec.replay_port}"
        insts.append(inst)
    doc: dict[str, Any] = {
        "block_size": BLOCK_SIZE,
        "tokenizer": str(models_dir() / "base"),
        "instances": insts,
        "gateway": {"health_interval_s": 0.5, "metrics_interval_s": 0.5},
        "parity": {"sample_rate": 0.0},
    }
    for k, v in over.items():
        doc[k] = v
    path.write_text(yaml.safe_dump(doc))
    return path


def _kvrouter(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvrouter.cli", *args]


class Served:
    """One ``kvrouter serve --workers 1`` process."""

    def __init__(self, fleet: Path, log_dir: Path, *, policy: str | None = None, port: int | None = None):
        self.fleet = fleet
        self.port = port or free_port()
        self.policy = policy
        self.log_path = log_dir / f"serve-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, timeout_s: float = 120.0) -> Served:
        args = ["serve", "--fleet", str(self.fleet), "--port", str(self.port), "--workers", "1"]
        if self.policy:
            args += ["--policy", self.policy]
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen(
            _kvrouter(*args), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession() as s:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"kvrouter serve exited {self.proc.returncode}:\n{self.log_tail()}")
                try:
                    async with s.get(self.url + "/health") as r:
                        body = await r.json()
                        if r.status == 200 and all(i["healthy"] for i in body["instances"].values()):
                            return self
                except (aiohttp.ClientError, TimeoutError, ValueError):
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"kvrouter serve not healthy in {timeout_s} s:\n{self.log_tail()}")
                await asyncio.sleep(0.2)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    async def health(self) -> dict[str, Any]:
        async with aiohttp.ClientSession() as s, s.get(self.url + "/health") as r:
            body: dict[str, Any] = await r.json()
            body["_status"] = r.status
            return body

    async def metrics(self) -> str:
        async with aiohttp.ClientSession() as s, s.get(self.url + "/metrics") as r:
            assert r.status == 200, r.status
            return await r.text()


def metric(text: str, name: str, **labels: str) -> float | None:
    """One sample of a Prometheus exposition (the first whose labels include ``labels``)."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        if head != name and not head.startswith(name + "{"):
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            return float(value)
    return None


def check(fleet: Path, timeout_s: float = 15.0) -> tuple[int, dict[str, Any]]:
    """``kvrouter check --json``: (exit status, report)."""
    r = subprocess.run(
        _kvrouter("check", "--fleet", str(fleet), "--json", "--timeout", str(timeout_s)),
        cwd=ROOT,
        capture_output=True,
        timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    try:
        return r.returncode, json.loads(r.stdout)
    except ValueError:
        raise AssertionError(
            f"check printed no JSON ({r.returncode}): {r.stdout!r} {r.stderr[-2000:]!r}"
        ) from None


class Outcome(msgspec.Struct):
    """One request through the router: where it went, what the router predicted, what vLLM reported."""

    route: str
    status: int
    instance: str | None
    predicted: int | None
    reported: int | None
    prompt_tokens: int | None
    body: dict[str, Any]


async def send(session: aiohttp.ClientSession, base: str, route: str, body: dict[str, Any]) -> Outcome:
    async with session.post(base + route, json=body) as r:
        data = await r.read()
        status = r.status
        if status != 200:
            return Outcome(route, status, None, None, None, None, {"error": data.decode(errors="replace")})
        predicted = r.headers.get("x-kvrouter-cached-tokens")
        instance = r.headers.get("x-kvrouter-instance")
    answer = json.loads(data)
    usage = read_usage(answer)
    return Outcome(
        route,
        status,
        instance,
        int(predicted) if predicted is not None else None,
        usage.cached_tokens if usage else None,
        usage.prompt_tokens if usage else None,
        answer,
    )


async def reset_caches(session: aiohttp.ClientSession, servers: list[RealVllm]) -> None:
    """vLLM's ``/reset_prefix_cache`` on each server; fails loudly if refused.  vLLM queues the reset's
    AllBlocksCleared and publishes it only with its next engine step (an idle engine runs none), so each
    server then gets a prompt shorter than a block: the clear is published, nothing is stored."""
    for s in servers:
        async with session.post(s.spec.url + "/reset_prefix_cache") as r:
            assert r.status == 200, (s.spec.name, r.status, await r.text())
        async with session.post(
            s.spec.url + "/v1/completions", json={"model": s.spec.served, "prompt": "reset", "max_tokens": 1}
        ) as r:
            assert r.status == 200, (s.spec.name, r.status, await r.text())


class Tally(msgspec.Struct):
    """Predicted against reported cached tokens over a run."""

    requests: int = 0
    exact: int = 0
    prompt_tokens: int = 0
    reported_cached: int = 0
    misses: list[dict[str, Any]] = []

    def add(self, i: int, o: Outcome) -> None:
        assert o.status == 200, (i, o.route, o.body)
        assert o.predicted is not None and o.reported is not None, (i, o.route, o.predicted, o.reported)
        self.requests += 1
        self.prompt_tokens += o.prompt_tokens or 0
        self.reported_cached += o.reported
        if o.predicted == o.reported:
            self.exact += 1
        else:
            self.misses.append(
                {
                    "i": i,
                    "route": o.route,
                    "instance": o.instance,
                    "predicted": o.predicted,
                    "reported": o.reported,
                }
            )

    @property
    def hit_rate(self) -> float:
        return self.reported_cached / self.prompt_tokens if self.prompt_tokens else 0.0

    def summary(self) -> str:
        return f"{self.exact}/{self.requests} exact, hit rate {self.hit_rate:.3f}" + (
            f", misses {self.misses}" if self.misses else ""
        )


async def _batches(s: aiohttp.ClientSession, health: str) -> dict[str, int]:
    async with s.get(health) as r:
        body = await r.json(content_type=None)
    return {src["instance"]: src.get("live_batches") or 0 for src in body.get("index", [])}


async def run_calls(
    base: str,
    calls: list[tuple[str, dict[str, Any]]],
    tally: Tally | None = None,
    *,
    health: str | None = None,
) -> Tally:
    """Each call in turn, sequential, so every prediction is held to the events of the requests before it.

    vLLM hands each step's events to a publisher thread while the answer travels on its own, so on a busy
    machine a client's next request can reach the router before the previous step's batch does (an agent's
    tool call between turns leaves that time).  With ``health`` (the router's /health), each call waits for
    the instance that served it to have published a batch since it was sent (every request that stores or
    evicts a block does; one that changed nothing may not, hence the bound), and then for its batches to
    stop coming for ``SETTLE_S``: a request's later steps (decode blocks allocated, evicting others) publish
    batches of their own, the last of them as late as its answer or later."""
    tally = tally or Tally()
    async with aiohttp.ClientSession() as s:
        for route, body in calls:
            before = await _batches(s, health) if health else {}
            o = await send(s, base, route, body)
            tally.add(tally.requests, o)
            if health and o.instance in before:
                await _settled(s, health, o.instance, before[o.instance])
    return tally


SETTLE_S = 0.05
"""A serving instance's batches have stopped once none came for this long (its engine steps are
milliseconds apart while it works)."""


async def _settled(s: aiohttp.ClientSession, health: str, instance: str, before: int) -> None:
    """Wait (at most 2 s) for ``instance`` to publish past ``before``, then to go ``SETTLE_S`` without a
    new batch."""
    deadline = time.monotonic() + 2.0
    seen, changed = before, None
    while time.monotonic() < deadline:
        n = (await _batches(s, health)).get(instance, 0)
        if n > seen:
            seen, changed = n, time.monotonic()
        elif changed is not None and time.monotonic() - changed >= SETTLE_S:
            return
        await asyncio.sleep(0.01)
