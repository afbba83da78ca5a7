"""Chat rendering as vLLM does it, typed errors for bad requests, and growing conversations."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.tokenizer_kit import CHATML_TEMPLATE, build_bytelevel, corpus_text
from tests.support.tokenizers import chat_ids, chat_text
from tokenizer_cache import (
    CacheConfig,
    CachedTokenizer,
    ChatTemplateError,
    NoChatTemplateError,
    UnsupportedContentError,
    chat_body,
    default_tokenizer_path,
)
from tokenizer_cache.messages import conversation, postprocess
from tokenizer_cache.request_schema import validate_messages
from tokenizer_cache.template import detect_content_format

TIGHT = CacheConfig(chunk_chars=32, margin_chars=8, overlap_chars=4, seam_stride_tokens=2)
PARTS_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% for part in message.content %}[{{ part.type }}]{{ part.text }}{% endfor %}<|im_end|>\n{% endfor %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {}}}},
    }
]


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CachedTokenizer]:
    ct = CachedTokenizer.from_pretrained(build_bytelevel(Path(tmp_path_factory.mktemp("bl"))), config=TIGHT)
    yield ct
    ct.close()


@pytest.fixture(scope="module")
def deepseek() -> Iterator[CachedTokenizer]:
    ct = CachedTokenizer.from_pretrained(default_tokenizer_path(), config=TIGHT)
    yield ct
    ct.close()


def _reference(ct: CachedTokenizer, conversation: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    """transformers directly: render, then tokenize without special tokens (what vLLM does)."""
    text = ct.hf_tokenizer.apply_chat_template(conversation, tokenize=False, **kwargs)
    return list(ct.hf_tokenizer(text, add_special_tokens=False)["input_ids"])


def test_plain_chat_matches_transformers(chat_tok: CachedTokenizer) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there 🙂"}]
    assert chat_ids(chat_tok, msgs) == _reference(chat_tok, msgs, add_generation_prompt=True)
    text = chat_text(chat_tok, msgs)
    assert text.endswith("<|im_start|>assistant\n")
    assert chat_ids(chat_tok, msgs, add_generation_prompt=False) == _reference(chat_tok, msgs)


def test_continue_final_message_and_kwargs(chat_tok: CachedTokenizer) -> None:
    msgs = [{"role": "user", "content": "Count:"}, {"role": "assistant", "content": "one, two"}]
    text = chat_text(chat_tok, msgs, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("one, two")
    with pytest.raises(ChatTemplateError, match="both"):
        chat_tok.render_chat_request(chat_body(msgs, continue_final_message=True))
    thinking_off = chat_text(chat_tok, msgs[:1], chat_template_kwargs={"enable_thinking": False})
    assert thinking_off.endswith("<think></think>")
    # the request's own fields override its kwargs, as in vLLM's merge; unknown keys are dropped
    text = chat_text(chat_tok, msgs[:1], chat_template_kwargs={"add_generation_prompt": False, "junk": 1})
    assert text.endswith("assistant\n")
    # tokenize=True in the kwargs: the template's text is the prompt, without added special tokens
    body = {"messages": msgs[:1], "chat_template_kwargs": {"tokenize": True}, "add_special_tokens": True}
    assert chat_tok.encode_chat_request(body).tokens == chat_ids(chat_tok, msgs[:1])


def test_vllm_message_normalization() -> None:
    msgs: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "x": 1},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"k": 2}'}}
            ],
            "reasoning_content": "hmm",
        },
        {"role": "tool", "content": "42", "tool_call_id": "c1", "name": "f"},
    ]

    def normalize(messages: list[dict[str, Any]], fmt: Any) -> list[dict[str, Any]]:
        conv = [conversation(m, fmt, n) for n, m in enumerate(validate_messages(messages))]
        postprocess(conv)
        return conv

    out = normalize(msgs, "string")
    assert out[0] == {"role": "user", "content": "a\nb"}
    assert out[1]["content"] == "" and out[1]["reasoning"] == "hmm" == out[1]["reasoning_content"]
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"k": 2}
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == '{"k": 2}', "input must not be mutated"
    assert out[2] == {"role": "tool", "content": "42", "tool_call_id": "c1", "name": "f"}
    assert normalize([{"role": "user", "content": "hi"}], "openai") == [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]}
    ]


def test_content_format_detection() -> None:
    assert detect_content_format(CHATML_TEMPLATE) == "string"
    assert detect_content_format(PARTS_TEMPLATE) == "openai"
    aliased = (
        "{% set msgs = messages[1:] %}"
        "{% for m in msgs %}{% for c in m['content'] %}{{ c }}{% endfor %}{% endfor %}"
    )
    assert detect_content_format(aliased) == "openai"


def test_openai_content_format_renders_parts(chat_tok: CachedTokenizer) -> None:
    text = chat_text(chat_tok, [{"role": "user", "content": "hi"}], chat_template=PARTS_TEMPLATE)
    assert text == "<|im_start|>user\n[text]hi<|im_end|>\n"


def test_tools_and_tool_calls_render_like_vllm(chat_tok: CachedTokenizer) -> None:
    msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "1"},
    ]
    text = chat_text(chat_tok, msgs, tools=TOOLS)
    assert '"description": null' in text and '<tool_call>get_weather {"city": "Paris"}</tool_call>' in text
    assert chat_ids(chat_tok, msgs, tools=TOOLS) == chat_tok.encode_uncached(text, add_special_tokens=False)


@pytest.mark.parametrize(
    ("messages", "kwargs", "error"),
    [
        ("not a list", {}, ChatTemplateError),
        ([{"content": "no role"}], {}, ChatTemplateError),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            {},
            UnsupportedContentError,
        ),
        ([{"role": "user", "content": [{"text": "no type"}]}], {}, ChatTemplateError),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{bad json"}}]}],
            {},
            ChatTemplateError,
        ),
        ([{"role": "user", "content": "x"}], {"chat_template": "{% for %}"}, ChatTemplateError),
        (
            [{"role": "user", "content": "x"}],
            {"chat_template": "{{ raise_exception('nope') }}"},
            ChatTemplateError,
        ),
        (
            [{"role": "user", "content": "x"}],
            {"chat_template": "{{ messages[5].content }}"},
            ChatTemplateError,
        ),
        # wrong JSON types where a list or a string belongs (found by the HTTP fuzz: once a TypeError)
        ([{"role": "user", "content": "x"}], {"tools": True}, ChatTemplateError),
        ([{"role": "user", "content": "x"}], {"tools": 7}, ChatTemplateError),
        ([{"role": "user", "content": "x"}], {"chat_template_kwargs": {"tools": 7}}, ChatTemplateError),
        (
            [{"role": "user", "content": "x"}],
            {"chat_template_kwargs": {"chat_template": 7}},
            ChatTemplateError,
        ),
        ([{"role": "user", "content": "x"}], {"documents": 3}, ChatTemplateError),
    ],
)
def test_bad_requests_raise_typed_errors(
    chat_tok: CachedTokenizer, messages: Any, kwargs: dict[str, Any], error: type[Exception]
) -> None:
    with pytest.raises(error):
        chat_tok.encode_chat_request(chat_body(messages, **kwargs))


def test_deepseek_has_no_template_unless_configured(deepseek: CachedTokenizer) -> None:
    msgs = [{"role": "user", "content": "hello"}]
    with pytest.raises(NoChatTemplateError, match="no chat template"):
        deepseek.encode_chat_request(chat_body(msgs))
    with_template = CachedTokenizer(deepseek.hf_tokenizer, chat_template=CHATML_TEMPLATE)
    text = chat_text(with_template, msgs)
    assert text == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert chat_ids(with_template, msgs) == deepseek.encode_uncached(text, add_special_tokens=False)
    # a per-request template wins over none
    assert chat_text(deepseek, msgs, chat_template=CHATML_TEMPLATE) == text


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), turns=st.integers(2, 8))
def test_growing_conversation_with_tool_calls(chat_tok: CachedTokenizer, seed: int, turns: int) -> None:
    """Each turn re-sends the whole history: cached == full, and the history is found and mostly reused
    (a reuse whose check fails is a fallback to a full encode: allowed, and rare)."""
    chat_tok.clear()
    before = chat_tok.stats()
    rng = random.Random(seed)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": corpus_text(rng, 40, ("<|im_end|>",))}]
    tools = TOOLS if seed % 2 else None
    reused = 0
    for t in range(turns):
        msgs.append({"role": "user", "content": corpus_text(rng, rng.randrange(1, 30))})
        res = chat_tok.encode_chat_request(chat_body(msgs, tools=tools))
        want = chat_tok.encode_uncached(chat_text(chat_tok, msgs, tools=tools), add_special_tokens=False)
        assert res.tokens == want, f"seed={seed} turn={t}"
        reused += res.reused_tokens
        if rng.random() < 0.5:
            args = json.dumps({"q": corpus_text(rng, 3)}, ensure_ascii=False)
            call = {"id": str(t), "type": "function", "function": {"name": "get_weather", "arguments": args}}
            msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
            msgs.append({"role": "tool", "content": corpus_text(rng, 5), "tool_call_id": str(t)})
        else:
            msgs.append({"role": "assistant", "content": corpus_text(rng, rng.randrange(1, 30))})
    st_ = chat_tok.stats()
    hits, fallbacks = st_.hits - before.hits, st_.fallbacks - before.fallbacks
    assert hits + fallbacks == turns - 1, (hits, fallbacks)
    assert hits >= (turns - 1) // 2 and (reused > 0) == (hits > 0)
