"""Token parity with vLLM 0.33: the recorded render-server answers (``make parity-fixtures``), replayed.

For every fixture (a parity model and the vLLM flags it was recorded with) the whole corpus goes through a
cold ``CachedTokenizer`` (the growing agent conversations then splice each turn onto the previous one),
then through the same tokenizer again from the event loop (warm: exact repeats), then, cache cleared, in
another order.
Every case must agree exactly: the same ids, or a typed error where vLLM answered 400.  No vLLM needed.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.parity_check import (
    Expected,
    Mismatch,
    expected_cases,
    load_corpus,
    load_model,
    recorded_models,
    render_options,
    run_async,
    run_sync,
)
from tests.support.parity_models import build_model, fingerprint
from tests.support.recorded import drift_note
from tokenizer_cache import CacheConfig, CachedTokenizer
from tokenizer_cache.loading import load_hf_tokenizer

MODELS = recorded_models()
# Small chunks: the cache splices at many more places than the production defaults allow.
SMALL = CacheConfig(chunk_chars=64, margin_chars=8, overlap_chars=8, seam_stride_tokens=4)


def _report(label: str, mismatches: list[Mismatch], total: int, recorded: dict[str, Any]) -> str:
    lines = [
        f"{label}: {len(mismatches)} of {total} cases differ from vLLM",
        drift_note(recorded["versions"]),
    ]
    lines += [f"  {m}" for m in mismatches[:25]]
    return "\n".join(lines)


ModelDirs = Callable[[str], tuple[Path, Any]]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> ModelDirs:
    """A parity model's directory and its loaded Hugging Face tokenizer, built once per model."""
    built: dict[str, tuple[Path, Any]] = {}

    def get(model: str) -> tuple[Path, Any]:
        if model not in built:
            directory = build_model(model, tmp_path_factory.mktemp(model) / model)
            built[model] = (directory, load_hf_tokenizer(str(directory)))
        return built[model]

    return get


def test_fixtures_cover_every_model_and_case() -> None:
    corpus = load_corpus()
    models = {load_model(name)["model"] for name in MODELS}
    assert models == {"deepseek_v3", "gemma3", "llama3_1", "qwen2_5", "qwen3"}
    assert len(MODELS) == 8, "the five models with the fixture flags, and three more server configurations"
    for name in MODELS:
        recorded = load_model(name)
        assert set(recorded["chat"]) == {c["id"] for c in corpus["chat"]}, name
        assert set(recorded["completion"]) == {c["id"] for c in corpus["completion"]}, name
        rendered = sum("ids" in r for r in recorded["chat"].values())
        assert rendered > len(corpus["chat"]) // 2, f"{name}: vLLM refused most of the corpus"


@pytest.mark.parametrize("name", MODELS)
async def test_tokens_match_vllm(name: str, model_dirs: ModelDirs) -> None:
    recorded = load_model(name)
    directory, hf = model_dirs(recorded["model"])
    assert fingerprint(directory) == recorded["fingerprint"], (
        f"{name}: the model directory built here differs from the one vLLM rendered with; "
        "rebuild the fixtures (make parity-fixtures)"
    )
    cases = list(expected_cases(load_corpus(), recorded))
    with CachedTokenizer(hf, config=SMALL, render_options=render_options(recorded)) as tok:
        cold = run_sync(tok, cases)
        assert tok.stats().hits > 0, "the growing conversations never reused the cache"
        warm = await run_async(tok, cases)
        assert tok.stats().exact_hits > 0
        tok.clear()
        shuffled: list[Expected] = cases[:]
        random.Random(7).shuffle(shuffled)
        other_order = run_sync(tok, shuffled)
    assert not cold, _report(f"{name} (cold cache)", cold, len(cases), recorded)
    assert not warm, _report(f"{name} (warm cache, async)", warm, len(cases), recorded)
    assert not other_order, _report(
        f"{name} (cache filled in another order)", other_order, len(cases), recorded
    )
