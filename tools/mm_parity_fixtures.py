"""Record vLLM's own multimodal prompts for the multimodal corpus (``make mm-parity-fixtures``; dev tool).

For each target (a tiny model directory of ``tests/support/mm_models.py`` and server flags) this starts
vLLM's GPU-less render server (``vllm launch render``) from the vLLM virtualenv, posts every body of
``tests/support/mm_corpus.py`` to its render route (chat, Responses, Messages), and keeps what vLLM
answered: the prompt's token ids, each item's identifier (``features.mm_hashes``) and placeholder range
(``features.mm_placeholders``), or the error.  Then vLLM's own block-key code (``tools/vllm_block_keys.py``,
run by the same virtualenv's python) gives, per prompt, the ``extra_keys`` its block pool would publish for
the prompt's full blocks (block size 16).  Output: ``tests/fixtures/multimodal/corpus.json`` (the bodies)
and ``tests/fixtures/multimodal/<target>.json``.

The model directory is built at a fixed path (``/tmp/kvrouter-mm/<model>``): vLLM hashes every item's bytes
together with the ``--model`` it was started with, and the fixture records that string (``model_id``).

Run from the repository root with the project's virtualenv:
``.venv/bin/python tools/mm_parity_fixtures.py [--venv ~/.cache/kvrouter/vllm-0.33.0-venv]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from parity_fixtures import RenderServer, _error, venv_python, versions  # noqa: E402

from tests.support.mm_corpus import build_mm_corpus  # noqa: E402
from tests.support.mm_models import build_mm_model, fingerprint  # noqa: E402

OUT = ROOT / "tests" / "fixtures" / "multimodal"
SEED = 20261203
BLOCK_SIZE = 16
BASE = Path("/tmp/kvrouter-mm")
FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "pythonic"]
TARGETS: dict[str, tuple[str, list[str]]] = {
    "qwen2_5_vl": ("qwen2_5_vl", FLAGS),
    "gemma3_mm": ("gemma3_mm", FLAGS),
    "gemma3_mm_pan_scan": (
        "gemma3_mm",
        [*FLAGS, "--mm-processor-kwargs", '{"do_pan_and_scan": true, "pan_and_scan_min_crop_size": 64}'],
    ),
}
ROUTES = {
    "chat": "/v1/chat/completions/render",
    "responses": "/v1/responses/render",
    "messages": "/v1/messages/render",
}


_OVERLAP = "mm_placeholders must be globally non-overlapping"


def _post(server: RenderServer, case: Any) -> dict[str, Any]:
    """The render route's answer; for a chat body the render route refuses only because its response
    model wants non-overlapping placeholder ranges (Gemma 3's ranges overlap when images are adjacent: the
    serving path takes them), the ids from ``/tokenize`` on the same messages (items then unrecorded)."""
    status, answer = server.post(ROUTES[case.route], case.body)
    got = _answer(status, answer)
    if case.route == "chat" and "error" in got and _OVERLAP in got["message"]:
        status, answer = server.post("/tokenize", case.body)
        if status == 200:
            return {"ids": list(answer["tokens"]), "items": None, "render_error": got["message"][:120]}
    return got


def _answer(status: int, answer: Any) -> dict[str, Any]:
    if status != 200:
        return _error(status, answer)
    feats = answer.get("features") or {}
    items = {
        m: [[h, p["offset"], p["length"]] for h, p in zip(hashes, feats["mm_placeholders"][m], strict=True)]
        for m, hashes in (feats.get("mm_hashes") or {}).items()
    }
    return {"ids": list(answer["token_ids"]), "items": items}


def block_keys(python: Path, cases: list[tuple[str, dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """vLLM's event extra keys for every recorded prompt (``tools/vllm_block_keys.py``)."""
    lines = [
        json.dumps(
            {
                "id": cid,
                "num_tokens": len(got["ids"]),
                "block_size": BLOCK_SIZE,
                "cache_salt": body.get("cache_salt"),
                "features": got["items"],
            }
        )
        for cid, body, got in cases
    ]
    out = subprocess.run(
        [str(python), str(ROOT / "tools" / "vllm_block_keys.py")],
        input="\n".join(lines) + "\n",
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {r["id"]: r["event_extra_keys"] for r in map(json.loads, out.splitlines()) if r}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", help="virtualenv with vLLM installed (default: as tools/parity_fixtures.py)")
    ap.add_argument("--vllm-version", default="0.33.0")
    ap.add_argument("--only", nargs="*", default=list(TARGETS))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--start-timeout", type=float, default=900.0)
    args = ap.parse_args()

    python = venv_python(args)
    ver = versions(python)
    print(f"vLLM {ver['vllm']}, transformers {ver['transformers']} ({python})", flush=True)
    corpus = build_mm_corpus(SEED)
    OUT.mkdir(parents=True, exist_ok=True)
    _write(OUT / "corpus.json", {"seed": SEED, "cases": [c.to_json() for c in corpus]})
    for name in args.only:
        model, flags = TARGETS[name]
        model_dir = build_mm_model(model, BASE / model)
        server = RenderServer(python, model_dir, flags, BASE / f"{name}.log")
        try:
            t0 = time.monotonic()
            server.wait_ready(args.start_timeout)
            with ThreadPoolExecutor(args.workers) as pool:
                answers = list(
                    pool.map(lambda c, s=server: _answer(*s.post(ROUTES[c.route], c.body)), corpus)
                )
        except Exception:
            print(Path(server.log.name).read_text()[-4000:], file=sys.stderr)
            raise
        finally:
            server.stop()
        done = [(c.id, c.body, a) for c, a in zip(corpus, answers, strict=True) if a.get("items") is not None]
        keys = block_keys(python, done)
        results = {}
        for c, a in zip(corpus, answers, strict=True):
            if a.get("items") is not None:
                a["event_extra_keys"] = keys[c.id]
            results[c.id] = a
        refused = sum("error" in a for a in answers)
        print(f"{name}: {len(answers)} cases ({refused} refused), {time.monotonic() - t0:.0f} s", flush=True)
        _write(
            OUT / f"{name}.json",
            {
                "model": model,
                "model_id": str(model_dir),
                "fingerprint": fingerprint(model_dir),
                "versions": ver,
                "flags": flags,
                "block_size": BLOCK_SIZE,
                "seed": SEED,
                "cases": results,
            },
        )


def _write(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
