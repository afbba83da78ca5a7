"""Replaying the parity corpus through a ``CachedTokenizer`` and comparing with vLLM's recorded answers.

Shared by the parity tests and ``tools/parity_report.py``.  A case agrees when vLLM returned ids and the
tokenizer returns exactly those ids, or when vLLM refused the request and the tokenizer raises one of its
typed errors (``TokenizerCacheError``: the gateway answers those with a 400, or routes media untokenized).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizer_cache import CachedTokenizer, Encoded, RenderOptions, TokenizerCacheError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "parity"


@dataclass(frozen=True)
class Expected:
    case_id: str
    kind: str  # "chat", "completion", "responses" or "messages"
    body: dict[str, Any]
    ids: list[Any] | None  # chat: list[int]; completion: list[list[int]]; None: vLLM refused it
    error: str | None


@dataclass(frozen=True)
class Mismatch:
    case_id: str
    detail: str

    def __str__(self) -> str:
        return f"{self.case_id}: {self.detail}"


def load_corpus() -> dict[str, Any]:
    return dict(json.loads((FIXTURES / "corpus.json").read_text(encoding="utf-8")))


def load_model(name: str) -> dict[str, Any]:
    return dict(json.loads((FIXTURES / f"{name}.json").read_text(encoding="utf-8")))


def recorded_models() -> list[str]:
    return sorted(p.stem for p in FIXTURES.glob("*.json") if p.stem != "corpus")


AGENT_ROUTES = ("responses", "messages")


def expected_cases(
    corpus: dict[str, Any], recorded: dict[str, Any], kinds: tuple[str, ...] = ("chat", "completion")
) -> Iterator[Expected]:
    """Every case of these kinds with vLLM's answer, ids decoded from their shared-prefix form."""
    for kind in ("chat", *AGENT_ROUTES):
        if kind not in kinds:
            continue
        prev: list[int] = []
        for case in corpus[kind]:
            answer = recorded[kind][case["id"]]
            if "error" in answer:
                yield Expected(
                    case["id"], kind, case["body"], None, f"{answer['error']}: {answer['message']}"
                )
                continue
            k, *tail = answer["ids"]
            prev = prev[:k] + tail
            yield Expected(case["id"], kind, case["body"], prev, None)
    if "completion" not in kinds:
        return
    for case in corpus["completion"]:
        answer = recorded["completion"][case["id"]]
        if "error" in answer:
            yield Expected(
                case["id"], "completion", case["body"], None, f"{answer['error']}: {answer['message']}"
            )
        else:
            yield Expected(case["id"], "completion", case["body"], answer["ids"], None)


def render_options(recorded: dict[str, Any]) -> RenderOptions:
    """The options matching the flags the render server ran with."""
    return RenderOptions.from_vllm_args(recorded["flags"], max_model_len=recorded["max_model_len"])


def _first_difference(want: list[int], got: list[int]) -> str:
    n = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    return f"first difference at position {n} of {len(want)} (vLLM) / {len(got)} (ours): " + (
        f"vLLM {want[n : n + 4]} ours {got[n : n + 4]}"
    )


def compare(exp: Expected, got: list[Encoded] | Encoded | Exception) -> Mismatch | None:
    if isinstance(got, Exception):
        if exp.ids is None and isinstance(got, TokenizerCacheError):
            return None
        if exp.ids is None:
            return Mismatch(
                exp.case_id, f"vLLM refused it; ours raised an untyped {type(got).__name__}: {got}"
            )
        return Mismatch(exp.case_id, f"vLLM rendered it; ours raised {type(got).__name__}: {got}")
    if exp.ids is None:
        return Mismatch(exp.case_id, f"vLLM refused it ({exp.error}); ours rendered it")
    if isinstance(got, Encoded):
        return (
            None if got.tokens == exp.ids else Mismatch(exp.case_id, _first_difference(exp.ids, got.tokens))
        )
    got_ids = [e.tokens for e in got]
    if len(got_ids) != len(exp.ids):
        return Mismatch(exp.case_id, f"{len(exp.ids)} prompts (vLLM), {len(got_ids)} (ours)")
    for i, (w, g) in enumerate(zip(exp.ids, got_ids, strict=True)):
        if w != g:
            return Mismatch(exp.case_id, f"prompt {i}: {_first_difference(w, g)}")
    return None


def _sync_call(tok: CachedTokenizer, kind: str) -> Callable[[dict[str, Any]], Any]:
    return {
        "chat": tok.encode_chat_request,
        "completion": tok.encode_completion_request,
        "responses": tok.encode_responses_request,
        "messages": tok.encode_messages_request,
    }[kind]


def _async_call(tok: CachedTokenizer, kind: str) -> Callable[[dict[str, Any]], Awaitable[Any]]:
    return {
        "chat": tok.aencode_chat_request,
        "completion": tok.aencode_completion_request,
        "responses": tok.aencode_responses_request,
        "messages": tok.aencode_messages_request,
    }[kind]


def run_sync(tok: CachedTokenizer, cases: list[Expected]) -> list[Mismatch]:
    out = []
    for exp in cases:
        call = _sync_call(tok, exp.kind)
        try:
            got = call({"model": "parity", **exp.body})
        except Exception as e:  # compared as a refusal
            got = e
        if (m := compare(exp, got)) is not None:
            out.append(m)
    return out


async def run_async(tok: CachedTokenizer, cases: list[Expected]) -> list[Mismatch]:
    out = []
    for exp in cases:
        call = _async_call(tok, exp.kind)
        try:
            got = await call({"model": "parity", **exp.body})
        except Exception as e:
            got = e
        if (m := compare(exp, got)) is not None:
            out.append(m)
    return out
