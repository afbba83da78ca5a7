"""vLLM's request handling, rule by rule, on literal requests (the fixtures check them against vLLM itself).

Each test names the vLLM behaviour it pins; ``docs/parity.md`` has the list.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.tokenizer_kit import build_bytelevel
from tokenizer_cache import (
    CachedTokenizer,
    ChatTemplateError,
    RenderOptions,
    RequestValidationError,
    UnsupportedContentError,
)
from tokenizer_cache.chat_request import merge_kwargs, plan_chat
from tokenizer_cache.messages import conversation, developer_to_system, postprocess
from tokenizer_cache.request_schema import validate_messages
from tokenizer_cache.template import detect_content_format

ECHO = (
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% if m.tool_calls %}{{ m.tool_calls | tojson }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}[gen]{% endif %}{{ x_var }}"
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CachedTokenizer]:
    with CachedTokenizer.from_pretrained(build_bytelevel(Path(tmp_path_factory.mktemp("bl")))) as ct:
        yield ct


def _conv(messages: list[dict[str, Any]], fmt: Any = "string") -> list[dict[str, Any]]:
    conv = [conversation(m, fmt, n) for n, m in enumerate(validate_messages(messages))]
    postprocess(conv)
    return conv


def test_parts_openai_does_not_declare_fail_alone_but_not_next_to_a_declared_one() -> None:
    """pydantic's union: alone, OpenAI's user type wins the tie and refuses the part when it is read."""
    with pytest.raises(RequestValidationError):
        _conv([{"role": "user", "content": [{"type": "input_text", "text": "b"}]}])
    mixed = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}]}
    ]
    assert _conv(mixed) == [{"role": "user", "content": "a\nb"}]
    # a custom role has only vLLM's type: accepted alone
    assert _conv([{"role": "ipython", "content": [{"type": "input_text", "text": "b"}]}])[0]["content"] == "b"


def test_tool_call_arguments_become_objects_and_keep_vllms_key_order() -> None:
    def call(args: Any) -> dict[str, Any]:
        fn = {"name": "f", "arguments": args, "x": 1}
        return {"type": "function", "function": fn, "id": "1", "index": 0}

    msgs = [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [call('{"b": 1, "a": 2}'), call("[1]"), call("{bad")],
        }
    ]
    calls = _conv(msgs)[0]["tool_calls"]
    assert [c["function"]["arguments"] for c in calls] == [{"b": 1, "a": 2}, {}, {}]
    assert list(calls[0]) == ["id", "function", "type", "index"]  # declared keys first, then extras
    assert list(calls[0]["function"]) == ["arguments", "name", "x"]
    assert msgs[0]["tool_calls"][0]["function"]["arguments"] == '{"b": 1, "a": 2}', (
        "the request is not edited"
    )
    with pytest.raises(RequestValidationError):  # arguments must be a string in the request
        _conv([{"role": "assistant", "content": "", "tool_calls": [call({"a": 1})]}])
    assert "tool_calls" not in _conv([{"role": "assistant", "content": "x", "tool_calls": []}])[0]


def test_tool_results_are_one_string_and_billing_headers_go() -> None:
    tool = {
        "role": "tool",
        "tool_call_id": "1",
        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
    }
    assert _conv([tool], "openai")[0] == {"role": "tool", "content": "a\nb", "tool_call_id": "1"}
    system = {"role": "system", "content": "x-anthropic-billing-header: cch=1\nBe brief."}
    assert _conv([system])[0]["content"] == "Be brief."
    assert _conv([{"role": "user", "content": system["content"]}])[0]["content"] == system["content"]


def test_developer_messages_merge_into_one_system_message_for_templates_without_the_role() -> None:
    conv = _conv([{"role": "user", "content": "u"}, {"role": "developer", "content": "d", "tools": None}])
    assert developer_to_system(conv, "{{ messages }}") == [
        {"role": "system", "content": "d"},
        {"role": "user", "content": "u"},
    ]
    assert developer_to_system(conv, "{% if m.role == 'developer' %}{% endif %}") is conv


def test_request_fields_win_over_kwargs_and_null_or_auto_never_override() -> None:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": "hi"}],
        "chat_template_kwargs": {
            "add_generation_prompt": False,
            "enable_thinking": None,
            "x": "auto",
            "y": 1,
        },
        "reasoning_effort": "none",
    }
    kwargs = plan_chat(body, RenderOptions(), None).kwargs
    assert kwargs["add_generation_prompt"] is True
    assert "enable_thinking" not in kwargs and "x" not in kwargs and kwargs["y"] == 1
    del body["chat_template_kwargs"]["enable_thinking"]
    assert plan_chat(body, RenderOptions(), None).kwargs["enable_thinking"] is False
    assert merge_kwargs({"a": 1, "b": 2}, {"a": None, "b": "auto", "c": 0}) == {"a": 1, "b": 2, "c": 0}


def test_server_flags_read_from_vllms_command_line() -> None:
    args = [
        "serve",
        "m",
        "--tool-call-parser",
        "hermes",
        "--enable-auto-tool-choice",
        "--max-model-len",
        "8192",
    ]
    args += [
        "--default-chat-template-kwargs",
        '{"enable_thinking": false}',
        "--chat-template-content-format=string",
    ]
    opts = RenderOptions.from_vllm_args(args)
    assert opts.tool_parser and not opts.trust_request_chat_template and opts.max_model_len == 8192
    assert opts.default_chat_template_kwargs == {"enable_thinking": False}
    assert opts.chat_template_content_format == "string"
    strict = RenderOptions.from_vllm_args([])
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [{"function": {"name": "f"}}]}
    with pytest.raises(RequestValidationError, match="tool_choice"):
        plan_chat(body, strict, None)  # tools default to tool_choice "auto", which needs a parser
    plan_chat({**body, "tool_choice": "none"}, strict, None)
    plan_chat(body, RenderOptions(), None)  # unknown flags: accepted


def test_content_format_detection_follows_vllm() -> None:
    assert detect_content_format("{% for m in messages %}{{ m.content }}{% endfor %}") == "string"
    assert (
        detect_content_format("{% for m in messages %}{% for c in m.content %}{% endfor %}{% endfor %}")
        == "openai"
    )
    macro = (
        "{% macro r(x) %}{% for c in x %}{% endfor %}{% endmacro %}"
        "{% for m in messages %}{{ r(m.content) }}{% endfor %}"
    )
    assert detect_content_format(macro) == "openai"
    ns = (
        "{% set ns = namespace(ms=messages) %}"
        "{% for m in ns.ms %}{% for c in m['content'] %}{% endfor %}{% endfor %}"
    )
    assert detect_content_format(ns) == "openai"
    # vLLM's detector fails on a loop over messages that unpacks: "string"
    assert (
        detect_content_format("{% for a, b in messages %}{% for c in b.content %}{% endfor %}{% endfor %}")
        == "string"
    )
    assert detect_content_format("{% for %}") == "string"


def test_rendering_and_tokenization_rules(tok: CachedTokenizer) -> None:
    base: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "chat_template": ECHO}
    assert tok.render_chat_request(base).text == "[user]hi[gen]"
    kwargs = {**base, "chat_template_kwargs": {"x_var": "!", "junk": 1}}
    assert tok.render_chat_request(kwargs).text == "[user]hi[gen]!"
    cont = {
        **base,
        "messages": [*base["messages"], {"role": "assistant", "content": "Sure, "}],
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    assert tok.render_chat_request(cont).text == "[user]hi[assistant]Sure, "
    for bad in ({"conversation": []}, {"return_assistant_tokens_mask": True}, {"messages": []}):
        with pytest.raises(ChatTemplateError):
            tok.encode_chat_request({**base, "chat_template_kwargs": bad})
    with pytest.raises(UnsupportedContentError):
        tok.encode_chat_request({**base, "messages": [{"role": "user", "content": [{"image_url": "x"}]}]})
    full = tok.encode_chat_request(base).tokens
    assert tok.encode_chat_request({**base, "truncate_prompt_tokens": 2}).tokens == full[-2:]
    assert tok.encode_chat_request({**base, "kv_transfer_params": {"prompt_token_ids": [3, 4]}}).tokens == [
        3,
        4,
    ]
    specials = tok.encode_chat_request({**base, "add_special_tokens": "yes"}).tokens
    assert specials == tok.encode_uncached("[user]hi[gen]", add_special_tokens=True) != full
    assert [e.tokens for e in tok.encode_completion_request({"prompt": [[5, 6], [7.0]]})] == [[5, 6], [7]]
    assert [
        e.tokens for e in tok.encode_completion_request({"prompt": ["1"], "add_special_tokens": False})
    ] == [tok.encode_uncached("1", add_special_tokens=False)]
