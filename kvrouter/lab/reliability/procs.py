"""Separate processes for the load and flood scenarios, and what the kernel says about them.

::

    this process (load generator, measurements) ──HTTP──▶ kvrouter serve (subprocess) ──▶ kvrouter sim
                                                  │            ▲ RSS, open fds: /proc/<pid>
                                                  └─ GET /metrics: loop tasks, requests, rejections

Every process binds 127.0.0.1 only, gets SIGINT then SIGKILL after a bound, and logs into one file.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import aiohttp
import msgspec
import yaml

from kvrouter.lab.reliability.stack import ScenarioError, free_port

STOP_TIMEOUT_S = 10.0


def kvrouter_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvrouter.cli", "--log-level", "WARNING", *args]


class Proc:
    """A child process: ``start``, ``stop`` (SIGINT, then SIGKILL past ``STOP_TIMEOUT_S``)."""

    def __init__(self, argv: list[str], log: IO[bytes], env: dict[str, str] | None = None) -> None:
        self.argv = argv
        self.log = log
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise ScenarioError("process not started")
        return self.proc.pid

    def start(self) -> None:
        env = {**os.environ, "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1", **(self.env or {})}
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=self.log, env=env)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGINT) -> None:
        p, self.proc = self.proc, None
        if p is None or p.poll() is not None:
            return
        p.send_signal(sig)
        try:
            p.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=STOP_TIMEOUT_S)


def rss_mb(pid: int) -> float:
    """Resident set size of ``pid`` in MiB (Linux ``/proc``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise ScenarioError(f"no VmRSS for {pid}")


def tree_pids(pid: int) -> list[int]:
    """``pid`` and every process under it (a ``kvrouter serve --workers N`` supervisor and its workers)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        with contextlib.suppress(OSError):
            todo.extend(int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split())
    return out


def tree_pss_mb(pid: int) -> float:
    """Proportional set size of ``pid``'s process tree in MiB: each page shared by the tree's processes
    (forked workers share what the supervisor loaded) counted once, divided among them."""
    total = 0
    for p in tree_pids(pid):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
    return total / 1024


class TcpConn(msgspec.Struct, frozen=True):
    local_port: int
    remote_port: int
    state: str
    """``ESTABLISHED``, ``CLOSE_WAIT``, ``LISTEN``... (Linux ``/proc/net/tcp``)."""


_TCP_STATES = {
    "01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV", "04": "FIN_WAIT1", "05": "FIN_WAIT2",
    "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT", "09": "LAST_ACK", "0A": "LISTEN", "0B": "CLOSING",
}  # fmt: skip


def tcp_connections(pid: int) -> list[TcpConn]:
    """The TCP sockets ``pid`` holds open, with their ports and states."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                f = line.split()
                if f[9] in inodes:
                    local, remote = f[1].rsplit(":", 1)[1], f[2].rsplit(":", 1)[1]
                    out.append(TcpConn(int(local, 16), int(remote, 16), _TCP_STATES.get(f[3], f[3])))
    return out


def slope_per_min(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (t seconds, value) samples, per minute."""
    if len(samples) < 3:
        return 0.0
    n = len(samples)
    mt = sum(t for t, _ in samples) / n
    mv = sum(v for _, v in samples) / n
    den = sum((t - mt) ** 2 for t, _ in samples)
    return 0.0 if den == 0 else 60.0 * sum((t - mt) * (v - mv) for t, v in samples) / den


async def wait_http(url: str, timeout_s: float = 90.0, proc: Proc | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as s:
        while time.monotonic() < deadline:
            if proc is not None and not proc.alive():
                raise ScenarioError(f"{proc.argv[3:5]} exited while starting")
            try:
                async with s.get(url) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.1)
    raise ScenarioError(f"{url} did not come up in {timeout_s} s")


async def metric(session: aiohttp.ClientSession, base: str, name: str, labels: str = "") -> float:
    """The sum of a metric's samples whose label text contains ``labels`` (0 if absent)."""
    async with session.get(f"{base}/metrics") as r:
        return _sum_metric(await r.text(), name, labels)


async def metric_per_worker(base: str, name: str, workers: int, tries: int = 200) -> dict[str, float]:
    """``name`` for each of the ``workers`` gateway processes behind ``base``, from one scrape (the host's
    /metrics labels per-worker series ``worker``).  One process, or a series summed over the host (no
    label): ``{"": value}``."""
    for _ in range(tries):
        async with (
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s,
            s.get(f"{base}/metrics") as r,
        ):
            text = await r.text()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith(name) and line[len(name)] in " {":
                m = re.search(r'worker="([^"]*)"', line)
                with contextlib.suppress(ValueError):
                    k = m.group(1) if m else ""
                    out[k] = out.get(k, 0.0) + float(line.rsplit(" ", 1)[1])
        if len(out) >= workers or "" in out:
            return out
        await asyncio.sleep(0.05)  # a worker not started yet
    raise ScenarioError(f"only workers {sorted(out)} of {workers} shown in /metrics")


def _sum_metric(text: str, name: str, labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {") and labels in line:
            with contextlib.suppress(ValueError):
                total += float(line.rsplit(" ", 1)[1])
    return total


class SimProcess:
    """``kvrouter sim`` in a child process; ``fleet`` is its fleet file once it is up."""

    def __init__(self, workdir: Path, log: IO[bytes], *args: str) -> None:
        self.fleet_file = workdir / "fleet.yaml"
        self.proc = Proc(
            kvrouter_argv("sim", "--fleet-out", str(self.fleet_file), "--base-port", "0", *args), log
        )

    async def start(self, timeout_s: float = 120.0) -> dict[str, Any]:
        self.proc.start()
        deadline = time.monotonic() + timeout_s
        while not self.fleet_file.exists():
            if not self.proc.alive():
                raise ScenarioError("kvrouter sim exited while starting")
            if time.monotonic() > deadline:
                raise ScenarioError("the simulated fleet did not come up")
            await asyncio.sleep(0.1)
        fleet: dict[str, Any] = yaml.safe_load(self.fleet_file.read_text())
        return fleet

    def stop(self) -> None:
        self.proc.stop(signal.SIGTERM)


class ServeProcess:
    """``kvrouter serve`` (the gateway) or ``kvrouter indexer`` in a child process, on a free port;
    ``workers``: ``kvrouter serve --workers`` (None: serve's default, the machine's cores)."""

    def __init__(
        self,
        command: str,
        fleet: dict[str, Any],
        workdir: Path,
        log: IO[bytes],
        name: str,
        workers: int | None = None,
    ) -> None:
        self.port = free_port()
        self.workers = workers
        path = workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(fleet, sort_keys=False))
        argv = kvrouter_argv(command, "--fleet", str(path), "--port", str(self.port))
        if workers is not None:
            argv += ["--workers", str(workers)]
        self.proc = Proc(argv, log)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, health: str = "/livez") -> None:
        self.proc.start()
        await wait_http(self.base + health, proc=self.proc)

    def stop(self) -> None:
        self.proc.stop()


def redis_binary() -> str | None:
    return shutil.which("redis-server")


class RedisProcess:
    """A ``redis-server`` on 127.0.0.1 that persists nothing; ``stop`` kills it (a crash, to clients)."""

    def __init__(self, log: IO[bytes], workdir: Path, port: int | None = None) -> None:
        binary = redis_binary()
        if binary is None:
            raise ScenarioError("redis-server is not installed")
        self.port = port or free_port()
        argv = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        argv += ["--dir", str(workdir), "--daemonize", "no", "--loglevel", "warning"]
        self.proc = Proc(argv, log)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        self.proc.start()
        deadline = time.monotonic() + 10
        while True:
            try:
                _, w = await asyncio.open_connection("127.0.0.1", self.port)
                w.close()
                return
            except OSError:
                if time.monotonic() > deadline or not self.proc.alive():
                    raise ScenarioError("redis-server did not start") from None
                await asyncio.sleep(0.05)

    def kill(self) -> None:
        self.proc.stop(signal.SIGKILL)
