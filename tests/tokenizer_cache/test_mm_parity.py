"""Multimodal prompts against vLLM's own recordings (``tools/mm_parity_fixtures.py``).

For every case of the corpus and every recorded target (two processor families, Gemma 3 with and without
pan-and-scan): the token ids, each item's identifier and placeholder range, and the per-block keys vLLM's
block pool publishes must be what the router computes; where vLLM refused the body, the router refuses it
with a typed error.  Then the index is fed vLLM's keys as a BlockStored event and must match the router's
chains for the same prompt on every full block.
"""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from indexer import Indexer
from indexer.encode import PayloadEncoder
from indexer.extra_keys import block_mm_keys, decode_block_keys, mm_request_chains
from tokenizer_cache import CachedTokenizer, ChatTemplateError, RenderOptions
from tokenizer_cache.agent_inputs import AgentInputError
from tokenizer_cache.errors import RequestValidationError
from tokenizer_cache.messages import UnsupportedContentError

from ..support.mm_models import build_mm_model, fingerprint

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "multimodal"
TARGETS = ("qwen2_5_vl", "gemma3_mm", "gemma3_mm_pan_scan")


@pytest.fixture(scope="module")
def corpus() -> list[dict[str, Any]]:
    return list(json.loads((FIXTURES / "corpus.json").read_text(encoding="utf-8"))["cases"])


@pytest.fixture(scope="module", params=TARGETS)
def target(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, Any], CachedTokenizer]:
    fx = json.loads((FIXTURES / f"{request.param}.json").read_text(encoding="utf-8"))
    d = build_mm_model(fx["model"], tmp_path_factory.mktemp(request.param) / fx["model"])
    assert fingerprint(d) == fx["fingerprint"], "the model directory differs from the one vLLM rendered"
    tok = CachedTokenizer.from_pretrained(
        str(d), mm_model_id=fx["model_id"], render_options=RenderOptions.from_vllm_args(fx["flags"])
    )
    assert tok.multimodal is not None
    return fx, tok


def _encode(tok: CachedTokenizer, route: str, body: dict[str, Any]) -> Any:
    if route == "chat":
        return tok.encode_chat_request(body)
    if route == "responses":
        return tok.encode_responses_request(body)
    return tok.encode_messages_request(body)


_OVERLAP = "mm_placeholders must be globally non-overlapping"


def _overlapping(items: Any) -> bool:
    return any(a.offset + a.length > b.offset for a, b in pairwise(items))


def _items(got: dict[str, Any]) -> list[tuple[str, int, int]]:
    return sorted((tuple(x) for m in got["items"].values() for x in m), key=lambda t: t[1])  # type: ignore[misc]


def test_every_case_as_vllm(
    target: tuple[dict[str, Any], CachedTokenizer], corpus: list[dict[str, Any]]
) -> None:
    fx, tok = target
    bs = fx["block_size"]
    mismatches: list[str] = []
    compared = refused = overlapped = 0
    for case in corpus:
        want = fx["cases"][case["id"]]
        try:
            enc = _encode(tok, case["route"], case["body"])
        except UnsupportedContentError as e:  # routed without ids: right where vLLM does not answer 400
            if want.get("error", 400) == 400:
                mismatches.append(
                    f"{case['id']}: routed untokenized ({e}) where vLLM answered {str(want)[:120]}"
                )
            continue
        except (ChatTemplateError, RequestValidationError, AgentInputError) as e:  # the gateway's 400
            if want.get("error") == 400:
                refused += 1
            else:
                mismatches.append(f"{case['id']}: refused ({e}) where vLLM answered {str(want)[:120]}")
            continue
        if "Cache miss" in want.get("message", ""):
            # A uuid without bytes: served from the instance's processor cache if it has the item (the
            # render server never has): the router routes it by name, to where that name is cached.
            # A family whose count depends on the size and a uuid never seen with its bytes: the exact prefix.
            named = [i.identifier for i in enc.mm] == ["named-1"] and enc.complete
            if not named and (enc.mm or enc.complete or enc.media_paths != ("prefix_only",)):
                mismatches.append(f"{case['id']}: named item {enc.mm}")
            continue
        if _OVERLAP in want.get("message", "") or want.get("render_error"):
            # vLLM's render route refuses a prompt whose placeholder ranges overlap (Gemma 3 ranges keep the
            # unmerged length: adjacent images overlap by the merged newlines), which its serving path
            # takes.  The router must find the same overlap, and (chat) the ids /tokenize recorded.
            if not _overlapping(enc.mm):
                mismatches.append(f"{case['id']}: vLLM found overlapping ranges, the router {list(enc.mm)}")
            elif "ids" in want and enc.tokens != want["ids"]:
                mismatches.append(f"{case['id']}: ids differ from /tokenize's")
            else:
                overlapped += 1
            continue
        if "error" in want:
            mismatches.append(f"{case['id']}: accepted where vLLM answered {want}")
            continue
        compared += 1
        if not enc.complete:
            mismatches.append(f"{case['id']}: incomplete ({enc.media_paths})")
            continue
        if enc.tokens != want["ids"]:
            mismatches.append(f"{case['id']}: ids differ ({len(enc.tokens)} vs {len(want['ids'])})")
            continue
        theirs_items = _items(want)
        if [tuple(i) for i in enc.mm] != theirs_items:
            mismatches.append(f"{case['id']}: items {list(enc.mm)} vs {theirs_items}")
            continue
        keys = want["event_extra_keys"] or []
        n = len(enc.tokens) // bs
        ours = block_mm_keys(enc.mm, n, bs)
        theirs = [decode_block_keys(k, None, first=i == 0).mm for i, k in enumerate(keys)] or [()] * n
        if ours != theirs:
            mismatches.append(f"{case['id']}: block keys {ours} vs {theirs}")
            continue
        salt = decode_block_keys(keys[0], None, first=True).salt if keys else None
        if salt != case["body"].get("cache_salt") and n:
            mismatches.append(f"{case['id']}: salt {salt!r}")
    assert not mismatches, f"{len(mismatches)} mismatches:\n" + "\n".join(mismatches[:20])
    assert compared > 100 and refused >= 3


def test_index_matches_vllm_events(
    target: tuple[dict[str, Any], CachedTokenizer], corpus: list[dict[str, Any]]
) -> None:
    """vLLM's keys, as a 0.33 BlockStored event, and the router's chains for the same prompt meet in the
    index on every full block; the same tokens without the items (a text prompt) match none of the blocks
    holding an item."""
    fx, tok = target
    bs = fx["block_size"]
    enc0 = PayloadEncoder("0.33.0")
    checked = 0
    for case in corpus:
        want = fx["cases"][case["id"]]
        if "error" in want or len(want["ids"]) < bs or not want.get("items"):
            continue
        n = len(want["ids"]) // bs
        ids = want["ids"][: n * bs]
        ix = Indexer(block_size=bs)
        ev = enc0.stored(list(range(1, n + 1)), None, ids, bs, extra_keys=want["event_extra_keys"])
        assert ix.apply_payload("vllm-0", enc0.batch([ev], ts=1.0)) == 1
        enc = _encode(tok, case["route"], case["body"])
        salt = case["body"].get("cache_salt")
        chains = mm_request_chains(enc.tokens, bs, enc.mm, cache_salt=salt)
        got = ix.lookup_chains(chains, len(enc.tokens)).instances
        assert [m.matched_blocks for m in got] == [n], case["id"]
        first_mm = min(o for _, o, _ in enc.mm) // bs
        plain = ix.lookup(enc.tokens, cache_salt=salt).instances
        assert [m.matched_blocks for m in plain] == [min(first_mm, n)], case["id"]
        checked += 1
    assert checked >= 40
