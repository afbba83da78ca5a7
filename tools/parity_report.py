"""Parity figures: the recorded vLLM answers (``tests/fixtures/parity/``) replayed, counted per fixture.

    .venv/bin/python tools/parity_report.py                      # this checkout's tokenizer_cache
    .venv/bin/python tools/parity_report.py --baseline 780950a   # also a past commit, through the API the
                                                                 # gateway used then (encode_chat_ex)

A dev tool.  A case agrees when the ids are identical, or when vLLM refused it (400) and the tokenizer
raised one of its typed errors.  The baseline replays chat bodies the way the gateway's ``FleetTokens``
called the tokenizer before the request entry points existed, and completions on their first prompt (all
the gateway tokenized then).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "parity"


def _cases(name: str) -> tuple[dict[str, Any], list[tuple[str, str, dict[str, Any], Any]]]:
    corpus = json.loads((FIXTURES / "corpus.json").read_text(encoding="utf-8"))
    recorded = json.loads((FIXTURES / f"{name}.json").read_text(encoding="utf-8"))
    out: list[tuple[str, str, dict[str, Any], Any]] = []
    prev: list[int] = []
    for case in corpus["chat"]:
        answer = recorded["chat"][case["id"]]
        if "error" in answer:
            out.append((case["id"], "chat", case["body"], None))
        else:
            k, *tail = answer["ids"]
            prev = prev[:k] + tail
            out.append((case["id"], "chat", case["body"], prev))
    for case in corpus["completion"]:
        answer = recorded["completion"][case["id"]]
        out.append((case["id"], "completion", case["body"], answer.get("ids")))
    return recorded, out


def _legacy(tok: Any, kind: str, body: dict[str, Any]) -> Any:
    """How the gateway's FleetTokens used the argument-style API (commit 780950a and before)."""
    if kind == "chat":
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
            raise ValueError("messages must be a non-empty list of objects")
        kwargs: dict[str, Any] = {
            "add_generation_prompt": body.get("add_generation_prompt", True) is not False,
            "continue_final_message": body.get("continue_final_message", False) is True,
        }
        if body.get("documents") is not None:
            kwargs["documents"] = body["documents"]
        if body.get("add_special_tokens") is True:
            kwargs["add_special_tokens"] = True
        return tok.encode_chat(
            msgs, tools=body.get("tools"), chat_template_kwargs=body.get("chat_template_kwargs"), **kwargs
        )
    p = body.get("prompt")
    if isinstance(p, list) and p and not all(isinstance(x, int) for x in p):
        p = p[0]
    if isinstance(p, list):
        return [p]
    if not isinstance(p, str):
        raise ValueError("prompt")
    return [tok.encode_prompt(p, add_special_tokens=body.get("add_special_tokens", True) is not False)]


def run(names: list[str], legacy: bool) -> dict[str, dict[str, int]]:
    sys.path.append(str(ROOT))  # after $PYTHONPATH: a baseline's tokenizer_cache comes first
    from tests.support.parity_models import build_model
    from tokenizer_cache import CachedTokenizer, TokenizerCacheError

    figures: dict[str, dict[str, int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            recorded, cases = _cases(name)
            directory = build_model(recorded["model"], Path(tmp) / name / recorded["model"])
            if legacy:
                tok = CachedTokenizer.from_pretrained(str(directory))
            else:
                from tokenizer_cache import RenderOptions

                options = RenderOptions.from_vllm_args(
                    recorded["flags"], max_model_len=recorded["max_model_len"]
                )
                tok = CachedTokenizer.from_pretrained(str(directory), render_options=options)
            counts = {
                "chat": 0,
                "chat_refused": 0,
                "chat_mismatch": 0,
                "completion": 0,
                "completion_mismatch": 0,
            }
            for _, kind, body, want in cases:
                try:
                    if legacy:
                        got: Any = _legacy(tok, kind, body)
                    elif kind == "chat":
                        got = tok.encode_chat_request(body).tokens
                    else:
                        got = [e.tokens for e in tok.encode_completion_request(body)]
                    ok = want is not None and (
                        got == want if kind == "chat" else (got == want[:1] if legacy else got == want)
                    )
                except TokenizerCacheError:
                    ok = want is None
                except Exception:  # an untyped error never agrees
                    ok = False
                counts[kind] += 1
                counts[f"{kind}_mismatch"] += not ok
                if kind == "chat" and want is None:
                    counts["chat_refused"] += 1
            tok.close()
            figures[name] = counts
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", help="a commit whose tokenizer_cache to replay through the old API too")
    ap.add_argument("--legacy-run", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    names = sorted(p.stem for p in FIXTURES.glob("*.json") if p.stem != "corpus")
    if args.legacy_run:
        print(json.dumps(run(names, legacy=True)))
        return
    tables = {"this checkout": run(names, legacy=False)}
    if args.baseline:
        with tempfile.TemporaryDirectory() as tmp:
            archive = subprocess.run(
                ["git", "-C", str(ROOT), "archive", args.baseline, "tokenizer_cache"],
                check=True,
                capture_output=True,
            ).stdout
            subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
            env = {**os.environ, "PYTHONPATH": tmp}
            out = subprocess.run(
                [sys.executable, __file__, "--legacy-run"],
                env=env,
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            tables[f"baseline {args.baseline}"] = json.loads(out.strip().splitlines()[-1])
    for label, figures in tables.items():
        total = {k: sum(f[k] for f in figures.values()) for k in next(iter(figures.values()))}
        print(f"{label}:")
        for name, f in {**figures, "total": total}.items():
            print(
                f"  {name:24s} chat {f['chat_mismatch']:4d} mismatches / {f['chat']} cases "
                f"({f['chat_refused']} refused by vLLM); "
                f"completions {f['completion_mismatch']} / {f['completion']}"
            )


if __name__ == "__main__":
    main()
