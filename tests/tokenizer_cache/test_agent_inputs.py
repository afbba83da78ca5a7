"""Responses and Messages requests render to vLLM 0.33's own token ids on the simulator's two templates
(fixtures recorded from its render server by ``tools/agent_fixtures.py``; the five parity templates are in
``test_agent_parity``), and the conversions' rules checked directly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.agent_corpus import messages_cases, responses_cases
from tests.support.agent_models import TEMPLATES, build_model, fingerprint
from tokenizer_cache import CachedTokenizer, RenderOptions, TokenizerCacheError
from tokenizer_cache.agent_inputs import AgentInputError, responses_messages
from tokenizer_cache.anthropic_inputs import (
    disabled_thinking_effort,
    messages_request,
    requires_system_first,
)
from tokenizer_cache.responses_request import plan_responses

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "agent_inputs"


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def model(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, CachedTokenizer, dict[str, Any]]:
    name = str(request.param)
    directory = build_model(name, tmp_path_factory.mktemp(name))
    recorded = json.loads((FIXTURES / f"{name}.json").read_text(encoding="utf-8"))
    assert recorded["fingerprint"] == fingerprint(directory), "the model directory is not what vLLM rendered"
    tok = CachedTokenizer.from_pretrained(str(directory))
    yield name, tok, recorded
    tok.close()


def _check(cid: str, want: dict[str, Any], got: list[int] | Exception) -> str | None:
    if "error" in want:
        return (
            None
            if isinstance(got, AgentInputError)
            else f"{cid}: vLLM refused ({want['message']}), we did not"
        )
    if isinstance(got, Exception):
        return f"{cid}: {got!r}"
    if got != want["ids"]:
        return f"{cid}: token ids differ"
    return None


def test_responses_render_as_vllm(model: tuple[str, CachedTokenizer, dict[str, Any]]) -> None:
    _name, tok, recorded = model
    bad = []
    for cid, body in responses_cases():
        got: list[int] | Exception
        try:
            got = tok.encode_responses_request(body).tokens
        except (AgentInputError, TokenizerCacheError) as e:
            got = e
        err = _check(cid, recorded["responses"][cid], got)
        if err:
            bad.append(err)
    assert not bad, bad


def test_messages_render_as_vllm(model: tuple[str, CachedTokenizer, dict[str, Any]]) -> None:
    _name, tok, recorded = model
    bad = []
    for cid, body in messages_cases():
        got: list[int] | Exception
        try:
            got = tok.encode_messages_request(body).tokens
        except (AgentInputError, TokenizerCacheError) as e:
            got = e
        err = _check(cid, recorded["messages"][cid], got)
        if err:
            bad.append(err)
    assert not bad, bad


def test_template_facts() -> None:
    assert requires_system_first(TEMPLATES["strict"])
    assert not requires_system_first(TEMPLATES["sim"])
    assert requires_system_first(None)
    # a template that ignores reasoning_effort renders "none" like every effort: vLLM sends "low"
    assert disabled_thinking_effort(lambda kw: "same") == "low"
    assert disabled_thinking_effort(lambda kw: json.dumps(kw)) == "none"

    def fails_on_none(kw: dict[str, Any]) -> str:
        if kw["reasoning_effort"] == "none":
            raise ValueError("no")
        return "x"

    assert disabled_thinking_effort(fails_on_none) == "low"


def test_previous_response_history() -> None:
    """A continued conversation: the stored messages minus system ones, then the stored output's text
    parts as assistant messages, then the new input; this turn's instructions only."""
    first = responses_messages("old", "Q1")
    output = [
        {"type": "reasoning", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "A1"}]},
    ]
    second = responses_messages("new", "Q2", previous_messages=first, previous_output=output)
    assert second == [
        {"role": "system", "content": "new"},
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "Q2"},
    ]


def test_items_merge_into_the_previous_assistant_message() -> None:
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    out = responses_messages(
        None,
        [
            {"role": "user", "content": "q"},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "r"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}]},
            call,
            {**call, "call_id": "c2"},
        ],
    )
    assert out[1] == {
        "role": "assistant",
        "reasoning": "r",
        "content": "a",
        "tool_calls": [
            {"id": "c1", "function": {"name": "f", "arguments": "{}"}, "type": "function"},
            {"id": "c2", "function": {"name": "f", "arguments": "{}"}, "type": "function"},
        ],
    }
    assert len(out) == 2


def test_refusals() -> None:
    with pytest.raises(AgentInputError, match="Unsupported input item type"):
        responses_messages(None, [{"type": "item_reference", "id": "x"}])
    with pytest.raises(AgentInputError, match="Encrypted"):
        responses_messages(None, [{"type": "reasoning", "summary": [], "encrypted_content": "z"}])
    with pytest.raises(AgentInputError, match="prompt template"):
        plan_responses({"input": "x", "prompt": {"id": "p"}}, RenderOptions(), None)
    with pytest.raises(AgentInputError, match="unknown content block"):
        messages_request({"messages": [{"role": "user", "content": [{"type": "video"}]}], "max_tokens": 5})


_leaf = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
_json = st.recursive(
    _leaf,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
    max_leaves=10,
)
_item = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(
            ["message", "function_call", "reasoning", "function_call_output", "custom_tool_call"]
        )
        | _json,
        "role": st.sampled_from(["user", "assistant", "system"]) | _json,
        "content": _json,
        "call_id": _json,
        "name": _json,
        "arguments": _json,
        "summary": _json,
        "status": _json,
    },
)


@settings(max_examples=400, deadline=None)
@given(
    st.fixed_dictionaries(
        {"input": st.text(max_size=8) | st.lists(_item | _json, max_size=4) | _json},
        optional={"instructions": _json, "tools": _json, "reasoning": _json, "chat_template_kwargs": _json},
    )
)
def test_any_responses_body_converts_or_is_refused(body: dict[str, Any]) -> None:
    """Whatever a client sends, the conversion answers a plan or vLLM's 400, never a crash."""
    try:
        out = plan_responses(body, RenderOptions(), None)
    except TokenizerCacheError:
        return
    assert isinstance(out.messages, list)


@settings(max_examples=400, deadline=None)
@given(
    st.fixed_dictionaries(
        {"messages": st.lists(st.fixed_dictionaries({"role": _json, "content": _json}), max_size=3) | _json},
        optional={
            "system": _json,
            "tools": _json,
            "tool_choice": _json,
            "thinking": _json,
            "output_config": _json,
        },
    ),
    st.booleans(),
)
def test_any_messages_body_converts_or_is_refused(body: dict[str, Any], merge: bool) -> None:
    try:
        out = messages_request({**body, "max_tokens": 8}, merge_inline_system=merge)
    except AgentInputError:
        return
    assert isinstance(out.body["messages"], list)
