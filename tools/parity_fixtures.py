"""Record vLLM's own token ids for the parity corpus (``make parity-fixtures``; a dev tool, not product code).

For every parity model (``tests/support/parity_models.py``) this starts vLLM's GPU-less render server
(``vllm launch render``, ``VLLM_TARGET_DEVICE=cpu``) from a separate virtualenv that has the pinned vLLM
release, posts every body of the corpus (``tests/support/parity_corpus.py``) to
``/v1/chat/completions/render`` or ``/v1/completions/render``, and writes what vLLM answered to
``tests/fixtures/parity/``; the Responses and Messages bodies (``tests/support/agent_parity_corpus.py``) go
to ``/v1/responses/render`` and ``/v1/messages/render``:

- ``corpus.json``: the request bodies (so the tests do not depend on the generator);
- ``<model>.json``: per route and case, the token ids (chat, responses, messages: ``[k, *tail]``, the first
  ``k`` ids shared with the previous case's of that route, then the rest) or ``{"error": status,
  "message": ...}``; with the model directory's fingerprint, the versions of vLLM and of the libraries
  that render and tokenize (transformers, tokenizers, jinja2: the tests name them when parity fails
  where ours differ) and the server flags.

The virtualenv: ``--venv`` or ``$PARITY_VLLM_VENV``; else ``/work/vllm/venv`` when it exists; else one is
created under ``~/.cache/kvrouter/`` with ``pip install vllm==VERSION`` (several GB; no GPU needed).
For a new vLLM release: ``make parity-fixtures VLLM_VERSION=x.y.z`` (and review what changed).

Run from the repository root with the project's virtualenv (it builds the model directories itself).
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

from tests.support.agent_parity_corpus import build_agent_corpus  # noqa: E402
from tests.support.parity_corpus import build_corpus  # noqa: E402
from tests.support.parity_models import MAX_MODEL_LEN, SPECS, build_model, fingerprint  # noqa: E402

OUT = ROOT / "tests" / "fixtures" / "parity"
SERVED = "parity"
AGENT_SEED = 20261203
# The flags the fixtures are recorded with (the tests build the matching RenderOptions): every model with
# FLAGS, and three more server configurations on one model each.
FLAGS = ["--trust-request-chat-template", "--enable-auto-tool-choice", "--tool-call-parser", "pythonic"]
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "qwen3_server_flags": (
        "qwen3",
        [
            *FLAGS,
            "--default-chat-template-kwargs",
            '{"enable_thinking": false, "x_var": "from the server"}',
            "--exclude-tools-when-tool-choice-none",
            "--reasoning-effort-map",
            '{"low": "none", "max": "high"}',
        ],
    ),
    "gemma3_string_format": ("gemma3", [*FLAGS, "--chat-template-content-format", "string"]),
    "llama3_1_default_flags": ("llama3_1", []),
}


def venv_python(args: argparse.Namespace) -> Path:
    """The vLLM virtualenv's python, creating the virtualenv if needed."""
    chosen = args.venv or os.environ.get("PARITY_VLLM_VENV")
    candidates = [Path(chosen)] if chosen else [Path("/work/vllm/venv")]
    for venv in candidates:
        if (venv / "bin" / "vllm").exists():
            return venv / "bin" / "python"
    venv = Path(chosen) if chosen else Path.home() / ".cache" / "kvrouter" / f"vllm-{args.vllm_version}-venv"
    if not (venv / "bin" / "vllm").exists():
        print(f"creating {venv} with vllm=={args.vllm_version} (several GB)...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "pip"), "install", "-q", f"vllm=={args.vllm_version}"]
        subprocess.run(pip, check=True)
    return venv / "bin" / "python"


def versions(python: Path) -> dict[str, str]:
    code = (
        "import importlib.metadata as m, json; "
        "print(json.dumps({p: m.version(p) for p in ('vllm', 'transformers', 'tokenizers', 'jinja2')}))"
    )
    out = subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RenderServer:
    """``vllm launch render`` on one model directory, in its own process group."""

    def __init__(self, python: Path, model_dir: Path, flags: list[str], log: Path) -> None:
        self.port = free_port()
        vllm = python.parent / "vllm"
        cmd = [str(vllm), "launch", "render", str(model_dir), "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--served-model-name", SERVED, *flags]
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


def _error(status: int, answer: Any) -> dict[str, Any]:
    message = answer.get("error", answer) if isinstance(answer, dict) else answer
    if isinstance(message, dict):
        message = message.get("message", message)
    return {"error": status, "message": str(message)[:300]}


# The render route of each corpus section; sections whose ids are stored as a shared prefix and a tail.
ROUTES = {
    "chat": "/v1/chat/completions/render",
    "completion": "/v1/completions/render",
    "responses": "/v1/responses/render",
    "messages": "/v1/messages/render",
}
PREFIXED = ("chat", "responses", "messages")


def record(
    server: RenderServer, corpus: dict[str, list[Any]], workers: int, sections: list[str]
) -> dict[str, Any]:
    def post(section: str, case: Any) -> Any:
        status, answer = server.post(ROUTES[section], case.body)
        if status != 200:
            return _error(status, answer)
        if section == "completion":
            return [list(r["token_ids"]) for r in answer]
        return list(answer["token_ids"])

    out: dict[str, Any] = {}
    with ThreadPoolExecutor(workers) as pool:
        for section in sections:
            got_all = list(pool.map(lambda c, s=section: post(s, c), corpus[section]))
            out[section] = {}
            prev: list[int] = []
            for case, got in zip(corpus[section], got_all, strict=True):
                if isinstance(got, dict) or section not in PREFIXED:
                    out[section][case.id] = got if isinstance(got, dict) else {"ids": got}
                    continue
                k = 0
                while k < min(len(prev), len(got)) and prev[k] == got[k]:
                    k += 1
                out[section][case.id] = {"ids": [k, *got[k:]]}
                prev = got
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", help="virtualenv with vLLM installed (default: see above)")
    ap.add_argument("--vllm-version", default="0.33.0", help="vLLM release for a new virtualenv")
    targets = {**{m: (m, FLAGS) for m in SPECS}, **VARIANTS}
    ap.add_argument("--only", nargs="*", default=sorted(targets), help="fixtures to record (default: all)")
    ap.add_argument("--seed", type=int, default=20261201)
    ap.add_argument("--workers", type=int, default=4, help="requests in flight per server")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument(
        "--routes",
        nargs="*",
        default=list(ROUTES),
        choices=list(ROUTES),
        help="corpus sections to record (default: all); the others are kept from the existing fixtures",
    )
    args = ap.parse_args()

    python = venv_python(args)
    ver = versions(python)
    print(f"vLLM {ver['vllm']}, transformers {ver['transformers']} ({python})", flush=True)
    corpus = {**build_corpus(args.seed), **build_agent_corpus(AGENT_SEED)}
    OUT.mkdir(parents=True, exist_ok=True)
    corpus_json = {"seed": args.seed, "agent_seed": AGENT_SEED}
    corpus_json.update({section: [c.to_json() for c in corpus[section]] for section in ROUTES})
    _write(OUT / "corpus.json", corpus_json)
    with tempfile.TemporaryDirectory(prefix="parity-") as tmp:
        for name in args.only:
            model, flags = targets[name]
            model_dir = build_model(model, Path(tmp) / name / model)
            server = RenderServer(python, model_dir, flags, Path(tmp) / f"{name}.log")
            try:
                t0 = time.monotonic()
                server.wait_ready(args.start_timeout)
                results = record(server, corpus, args.workers, args.routes)
            except Exception:
                print(Path(server.log.name).read_text()[-4000:], file=sys.stderr)
                raise
            finally:
                server.stop()
            counts = ", ".join(
                f"{len(r)} {section} ({sum('error' in x for x in r.values())} refused)"
                for section, r in results.items()
            )
            print(f"{name}: {counts}, {time.monotonic() - t0:.0f} s", flush=True)
            path = OUT / f"{name}.json"
            kept = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
            kept = {s: kept[s] for s in ROUTES if s in kept and s not in results}
            _write(
                path,
                {
                    "model": model,
                    "fingerprint": fingerprint(model_dir),
                    "versions": ver,
                    "flags": flags,
                    "max_model_len": MAX_MODEL_LEN,
                    "seed": args.seed,
                    "agent_seed": AGENT_SEED,
                    **kept,
                    **results,
                },
            )


def _write(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
