"""The Responses and Messages request bodies whose tokens vLLM's render server recorded
(``tools/agent_fixtures.py``) and the tests compare against: every input-item kind, the conversions'
edge cases (merging into the previous assistant message, continuing a partial answer, billing headers,
inline system messages, tool changes), and a seeded set of random agent conversations."""

from __future__ import annotations

import random
from typing import Any

Body = dict[str, Any]

WORDS = [
    "cache",
    "router",
    "block",
    "token",
    "prefix",
    "agent",
    "tool",
    "search",
    "file",
    "read",
    "write",
    "plan",
    "test",
    "result",
]


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


FN_TOOL = {
    "type": "function",
    "name": "read_file",
    "description": "Read a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
}


def responses_cases() -> list[tuple[str, Body]]:
    """(id, body) of /v1/responses requests (without ``model``)."""
    call = {
        "type": "function_call",
        "call_id": "call_1",
        "name": "read_file",
        "arguments": '{"path": "a.py"}',
    }
    out = {"type": "function_call_output", "call_id": "call_1", "output": "print(1)"}
    assistant = {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "I will read it."}],
    }
    reasoning = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "think of files"}]}
    cases: list[tuple[str, Body]] = [
        ("string", {"input": "Hello there"}),
        ("instructions", {"input": "Hi", "instructions": "You are terse."}),
        ("empty_instructions", {"input": "Hi", "instructions": ""}),
        ("user_item_str", {"input": [{"role": "user", "content": "Hi"}]}),
        ("user_item_typed", {"input": [{"type": "message", "role": "user", "content": "Hi"}]}),
        (
            "user_parts",
            {
                "input": [
                    {
                        "role": "user",
                        "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
                    }
                ]
            },
        ),
        ("user_extra_keys", {"input": [{"role": "user", "content": "Hi", "name": "bob", "id": "x1"}]}),
        (
            "system_item",
            {"input": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
        ),
        (
            "developer_item",
            {"input": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Q"}]},
        ),
        (
            "assistant_str",
            {
                "input": [
                    {"role": "user", "content": "Q"},
                    {"role": "assistant", "content": "A"},
                    {"role": "user", "content": "Q2"},
                ]
            },
        ),
        (
            "assistant_output",
            {"input": [{"role": "user", "content": "Q"}, assistant, {"role": "user", "content": "Q2"}]},
        ),
        (
            "call_and_output",
            {"input": [{"role": "user", "content": "Read a.py"}, call, out], "tools": [FN_TOOL]},
        ),
        (
            "assistant_then_call",
            {"input": [{"role": "user", "content": "Read"}, assistant, call, out], "tools": [FN_TOOL]},
        ),
        (
            "two_calls",
            {
                "input": [
                    {"role": "user", "content": "Read"},
                    call,
                    {**call, "call_id": "call_2", "arguments": '{"path": "b.py"}'},
                    out,
                    {**out, "call_id": "call_2"},
                ],
                "tools": [FN_TOOL],
            },
        ),
        (
            "reasoning_then_message",
            {
                "input": [
                    {"role": "user", "content": "Q"},
                    reasoning,
                    assistant,
                    {"role": "user", "content": "Q2"},
                ]
            },
        ),
        (
            "reasoning_content",
            {
                "input": [
                    {"role": "user", "content": "Q"},
                    {**reasoning, "content": [{"type": "reasoning_text", "text": "deep"}]},
                    assistant,
                    {"role": "user", "content": "more"},
                ]
            },
        ),
        (
            "reasoning_then_call",
            {"input": [{"role": "user", "content": "Q"}, reasoning, call, out], "tools": [FN_TOOL]},
        ),
        (
            "partial_assistant",
            {"input": [{"role": "user", "content": "Count"}, {**assistant, "status": "incomplete"}]},
        ),
        (
            "partial_in_progress",
            {"input": [{"role": "user", "content": "Count"}, {**assistant, "status": "in_progress"}]},
        ),
        (
            "completed_assistant_last",
            {"input": [{"role": "user", "content": "Count"}, {**assistant, "status": "completed"}]},
        ),
        ("tools_plain", {"input": "weather?", "tools": [FN_TOOL]}),
        (
            "tools_strict",
            {
                "input": "weather?",
                "tools": [{**FN_TOOL, "strict": True}, {"type": "function", "name": "noparams"}],
            },
        ),
        (
            "namespace_tool",
            {
                "input": "x",
                "tools": [
                    {"type": "namespace", "name": "fs", "description": "files", "tools": [{**FN_TOOL}]}
                ],
            },
        ),
        (
            "custom_tool",
            {"input": "x", "tools": [{"type": "custom", "name": "patch", "description": "apply a patch"}]},
        ),
        ("builtin_tool_only", {"input": "x", "tools": [{"type": "web_search_preview"}]}),
        (
            "custom_call",
            {
                "input": [
                    {"role": "user", "content": "p"},
                    {"type": "custom_tool_call", "call_id": "c9", "name": "patch", "input": "diff --git ü"},
                    {"type": "custom_tool_call_output", "call_id": "c9", "output": "ok"},
                ],
                "tools": [{"type": "custom", "name": "patch"}],
            },
        ),
        ("namespaced_call", {"input": [{"role": "user", "content": "r"}, {**call, "namespace": "fs"}, out]}),
        ("effort_low", {"input": "Hi", "reasoning": {"effort": "low"}}),
        ("effort_none", {"input": "Hi", "reasoning": {"effort": "none"}}),
        (
            "effort_kwargs",
            {
                "input": "Hi",
                "reasoning": {"effort": "high"},
                "chat_template_kwargs": {"enable_thinking": False},
            },
        ),
        ("kwargs_agp", {"input": "Hi", "chat_template_kwargs": {"add_generation_prompt": False}}),
        ("unicode", {"input": "naïve café 東京 🚀", "instructions": "Réponds en français."}),
        (
            "output_list",
            {
                "input": [
                    {"role": "user", "content": "r"},
                    call,
                    {
                        **out,
                        "output": [
                            {"type": "input_text", "text": "l1"},
                            {"type": "input_text", "text": "l2"},
                        ],
                    },
                ]
            },
        ),
        ("bad_item", {"input": [{"type": "item_reference", "id": "msg_1"}]}),
        (
            "encrypted",
            {"input": [{"role": "user", "content": "q"}, {**reasoning, "encrypted_content": "xx"}]},
        ),
    ]
    rng = random.Random(20261207)
    for i in range(12):
        items: list[dict[str, Any]] = [{"role": "user", "content": _text(rng, rng.randint(3, 30))}]
        for turn in range(rng.randint(1, 4)):
            cid = f"call_{i}_{turn}"
            if rng.random() < 0.4:
                items.append(
                    {"type": "reasoning", "summary": [{"type": "summary_text", "text": _text(rng, 5)}]}
                )
            if rng.random() < 0.5:
                items.append({**assistant, "content": [{"type": "output_text", "text": _text(rng, 8)}]})
            if rng.random() < 0.6:
                items.append({**call, "call_id": cid, "arguments": f'{{"path": "{rng.choice(WORDS)}.py"}}'})
                items.append({**out, "call_id": cid, "output": _text(rng, rng.randint(1, 40))})
            else:
                items.append({"role": "user", "content": _text(rng, rng.randint(2, 20))})
        body: Body = {"input": items, "tools": [FN_TOOL]}
        if rng.random() < 0.5:
            body["instructions"] = _text(rng, 12)
        cases.append((f"random_{i}", body))
    return cases


def messages_cases() -> list[tuple[str, Body]]:
    """(id, body) of /v1/messages requests (without ``model``)."""
    tool = {
        "name": "read_file",
        "description": "Read a file",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
    }
    use = {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "a.py"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "print(1)"}
    cases: list[tuple[str, Body]] = [
        ("plain", {"messages": [{"role": "user", "content": "Hello"}]}),
        ("system_str", {"system": "You are terse.", "messages": [{"role": "user", "content": "Hi"}]}),
        (
            "system_blocks",
            {
                "system": [
                    {"type": "text", "text": "x-anthropic-billing-header: cc=1"},
                    {"type": "text", "text": "Part A. "},
                    {"type": "text", "text": "Part B."},
                ],
                "messages": [{"role": "user", "content": "Hi"}],
            },
        ),
        (
            "text_blocks",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    }
                ]
            },
        ),
        ("one_block", {"messages": [{"role": "user", "content": [{"type": "text", "text": "only"}]}]}),
        (
            "tool_round",
            {
                "tools": [tool],
                "messages": [
                    {"role": "user", "content": "read a.py"},
                    {"role": "assistant", "content": [{"type": "text", "text": "Sure."}, use]},
                    {"role": "user", "content": [result]},
                ],
            },
        ),
        (
            "tool_result_with_text",
            {
                "tools": [tool],
                "messages": [
                    {"role": "user", "content": "go"},
                    {"role": "assistant", "content": [use]},
                    {"role": "user", "content": [result, {"type": "text", "text": "now summarise"}]},
                ],
            },
        ),
        (
            "tool_result_blocks",
            {
                "tools": [tool],
                "messages": [
                    {"role": "user", "content": "go"},
                    {"role": "assistant", "content": [use]},
                    {
                        "role": "user",
                        "content": [
                            {
                                **result,
                                "content": [{"type": "text", "text": "l1"}, {"type": "text", "text": "l2"}],
                            }
                        ],
                    },
                ],
            },
        ),
        (
            "thinking",
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "thinking", "thinking": "hmm", "signature": "s"},
                            {"type": "text", "text": "a"},
                        ],
                    },
                    {"role": "user", "content": "q2"},
                ]
            },
        ),
        (
            "inline_system",
            {
                "system": "S1",
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "system", "content": "reminder"},
                    {"role": "user", "content": "q2"},
                ],
            },
        ),
        (
            "inline_system_only",
            {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}]},
        ),
        (
            "thinking_disabled",
            {"thinking": {"type": "disabled"}, "messages": [{"role": "user", "content": "q"}]},
        ),
        ("effort", {"output_config": {"effort": "high"}, "messages": [{"role": "user", "content": "q"}]}),
        (
            "tool_choice_any",
            {"tools": [tool], "tool_choice": {"type": "any"}, "messages": [{"role": "user", "content": "q"}]},
        ),
        (
            "tool_removal",
            {
                "tools": [tool, {**tool, "name": "write_file"}],
                "messages": [
                    {
                        "role": "system",
                        "content": [
                            {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "write_file"}}
                        ],
                    },
                    {"role": "user", "content": "q"},
                ],
            },
        ),
        (
            "assistant_last",
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "The answer is"},
                ]
            },
        ),
        ("unicode", {"system": "Réponds.", "messages": [{"role": "user", "content": "東京 🚀 naïve"}]}),
        ("bad_block", {"messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]}),
    ]
    rng = random.Random(20261208)
    for i in range(10):
        msgs: list[dict[str, Any]] = [{"role": "user", "content": _text(rng, rng.randint(3, 25))}]
        for turn in range(rng.randint(1, 4)):
            tid = f"toolu_{i}_{turn}"
            blocks: list[dict[str, Any]] = []
            if rng.random() < 0.3:
                blocks.append({"type": "thinking", "thinking": _text(rng, 6), "signature": "sig"})
            if rng.random() < 0.6:
                blocks.append({"type": "text", "text": _text(rng, 7)})
            blocks.append({**use, "id": tid, "input": {"path": rng.choice(WORDS)}})
            msgs.append({"role": "assistant", "content": blocks})
            reply: list[dict[str, Any]] = [
                {**result, "tool_use_id": tid, "content": _text(rng, rng.randint(1, 30))}
            ]
            if rng.random() < 0.3:
                reply.append({"type": "text", "text": _text(rng, 5)})
            msgs.append({"role": "user", "content": reply})
        body: Body = {"messages": msgs, "tools": [tool], "max_tokens": 64}
        if rng.random() < 0.6:
            body["system"] = _text(rng, 15)
        cases.append((f"random_{i}", body))
    for _, b in cases:
        b.setdefault("max_tokens", 64)
    return cases
