"""Responses and Messages parity with vLLM 0.33: its render server's answers for ``/v1/responses/render``
and ``/v1/messages/render`` (``make parity-fixtures``), replayed through ``CachedTokenizer``.

For every fixture (a parity model and the vLLM flags it was recorded with) both corpora go through a cold
tokenizer (the growing agent loops splice each turn onto the previous one), then warm from the event
loop.  Every case must agree exactly: the same ids, or a typed error where vLLM answered 400.  A fixture
without these sections fails (the corpus is recorded for every model): nothing is skipped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.parity_check import (
    AGENT_ROUTES,
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
SMALL = CacheConfig(chunk_chars=64, margin_chars=8, overlap_chars=8, seam_stride_tokens=4)
# What the corpus is built to reach: enough cases of both routes, and enough that vLLM renders.
MIN_CASES = {"responses": 350, "messages": 220}


def _report(label: str, mismatches: list[Mismatch], total: int, recorded: dict[str, Any]) -> str:
    lines = [
        f"{label}: {len(mismatches)} of {total} cases differ from vLLM",
        drift_note(recorded["versions"]),
    ]
    lines += [f"  {m}" for m in mismatches[:30]]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    built: dict[str, tuple[Path, Any]] = {}

    def get(model: str) -> tuple[Path, Any]:
        if model not in built:
            directory = build_model(model, tmp_path_factory.mktemp(model) / model)
            built[model] = (directory, load_hf_tokenizer(str(directory)))
        return built[model]

    return get


def test_every_fixture_records_both_routes() -> None:
    corpus = load_corpus()
    assert {load_model(n)["model"] for n in MODELS} == {
        "deepseek_v3",
        "gemma3",
        "llama3_1",
        "qwen2_5",
        "qwen3",
    }
    for route in AGENT_ROUTES:
        ids = {c["id"] for c in corpus[route]}
        assert len(ids) >= MIN_CASES[route], route
        for name in MODELS:
            recorded = load_model(name)
            assert route in recorded, f"{name}: no {route} fixtures (make parity-fixtures)"
            assert set(recorded[route]) == ids, f"{name}: {route} fixtures are not the corpus's"
            rendered = sum("ids" in r for r in recorded[route].values())
            assert rendered > len(ids) // 4, f"{name}: vLLM refused most of the {route} corpus"


@pytest.mark.parametrize("route", AGENT_ROUTES)
@pytest.mark.parametrize("name", MODELS)
async def test_agent_tokens_match_vllm(name: str, route: str, model_dirs: Any) -> None:
    recorded = load_model(name)
    directory, hf = model_dirs(recorded["model"])
    assert fingerprint(directory) == recorded["fingerprint"], f"{name}: rebuild the fixtures"
    cases = list(expected_cases(load_corpus(), recorded, (route,)))
    assert cases, f"{name}: no {route} cases"
    with CachedTokenizer(hf, config=SMALL, render_options=render_options(recorded)) as tok:
        cold = run_sync(tok, cases)
        warm = await run_async(tok, cases)
    assert not cold, _report(f"{name} {route} (cold cache)", cold, len(cases), recorded)
    assert not warm, _report(f"{name} {route} (warm cache, async)", warm, len(cases), recorded)
