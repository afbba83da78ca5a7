"""Record vLLM's own token ids for the Responses and Messages corpus (a dev tool, not product code).

For each model directory of ``tests/support/agent_models.py`` this starts vLLM's GPU-less render server
(``vllm launch render``, ``VLLM_TARGET_DEVICE=cpu``) from the virtualenv that has vLLM installed
(``--venv``, default ``/work/vllm/venv``), posts every body of ``tests/support/agent_corpus.py`` to
``/v1/responses/render`` or ``/v1/messages/render``, and writes what vLLM answered to
``tests/fixtures/agent_inputs/<model>.json``: per case the token ids, or ``{"error": status, "message"}``,
with the model directory's fingerprint and the vLLM version.

    .venv/bin/python tools/agent_fixtures.py [--venv /path/to/venv-with-vllm]

Run from the repository root with the project's virtualenv.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.agent_corpus import messages_cases, responses_cases  # noqa: E402
from tests.support.agent_models import MAX_MODEL_LEN, TEMPLATES, build_model, fingerprint  # noqa: E402

OUT = ROOT / "tests" / "fixtures" / "agent_inputs"
SERVED = "agent"
# Tool choice "auto" (what a Messages request with tools asks for) needs a tool parser on the server.
FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "pythonic"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RenderServer:
    """``vllm launch render`` on one model directory, in its own process group."""

    def __init__(self, venv: Path, model_dir: Path, log: Path) -> None:
        self.port = free_port()
        cmd = [str(venv / "bin" / "vllm"), "launch", "render", str(model_dir)]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", SERVED]
        cmd += ["--max-model-len", str(MAX_MODEL_LEN), *FLAGS]
        env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the render server exited ({self.proc.returncode}); see {self.log.name}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return
            except OSError:
                time.sleep(1)
        raise RuntimeError(f"the render server did not start in {timeout:.0f} s; see {self.log.name}")

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        data = json.dumps({"model": SERVED, **body}).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}", data=data, headers={"content-type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                return e.code, json.loads(raw)
            except ValueError:
                return e.code, raw.decode(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def _answer(status: int, answer: Any) -> dict[str, Any]:
    if status == 200:
        return {"ids": list(answer["token_ids"])}
    message = answer.get("error", answer) if isinstance(answer, dict) else answer
    if isinstance(message, dict):
        message = message.get("message", message)
    return {"error": status, "message": str(message)[:300]}


def record(server: RenderServer, workers: int) -> dict[str, Any]:
    jobs = [("responses", cid, "/v1/responses/render", b) for cid, b in responses_cases()]
    jobs += [("messages", cid, "/v1/messages/render", b) for cid, b in messages_cases()]
    with ThreadPoolExecutor(workers) as pool:
        answers = list(pool.map(lambda j: _answer(*server.post(j[2], j[3])), jobs))
    out: dict[str, Any] = {"responses": {}, "messages": {}}
    for (kind, cid, _, _), got in zip(jobs, answers, strict=True):
        out[kind][cid] = got
    return out


def vllm_version(venv: Path) -> str:
    code = "import importlib.metadata as m; print(m.version('vllm'))"
    return subprocess.run(
        [str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", default=os.environ.get("AGENT_VLLM_VENV", "/work/vllm/venv"))
    ap.add_argument("--models", nargs="*", default=sorted(TEMPLATES))
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    args = ap.parse_args()
    venv = Path(args.venv)
    version = vllm_version(venv)
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="agent-fixtures-") as tmp:
        for name in args.models:
            model_dir = build_model(name, Path(tmp) / name)
            server = RenderServer(venv, model_dir, Path(tmp) / f"{name}.log")
            try:
                t0 = time.monotonic()
                server.wait_ready(args.start_timeout)
                results = record(server, args.workers)
            except Exception:
                print(Path(server.log.name).read_text()[-4000:], file=sys.stderr)
                raise
            finally:
                server.stop()
            refused = sum("error" in r for k in results for r in results[k].values())
            n = sum(map(len, results.values()))
            print(f"{name}: {n} cases ({refused} refused), {time.monotonic() - t0:.0f} s")
            doc = {"model": name, "fingerprint": fingerprint(model_dir), "vllm": version, **results}
            text = json.dumps(doc, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
            (OUT / f"{name}.json").write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
