"""The seeded Responses and Messages corpus of the vLLM parity fixtures (``/v1/responses`` and
``/v1/messages`` bodies, as clients send them; the case id starts with the family name).

``build_agent_corpus(seed)`` returns ``{"responses": [Case...], "messages": [Case...]}``; every body goes to
vLLM's ``/v1/responses/render`` or ``/v1/messages/render`` on every parity model (``tools/
parity_fixtures.py``), and the tests replay the same bodies through ``CachedTokenizer``.  The bodies are
stored with the fixtures (``parity/corpus.json``).

Responses families: ``rstr`` (string input, instructions absent / null / empty / short / long),
``ritems`` (every input item type the protocol takes, with and without ``type``, ``status``, ``id``,
extra keys, text parts, refusals, several output parts), ``rtools`` (function, custom, namespace and
built-in tools, ``tools: []``, every ``tool_choice``), ``rcalls`` (function / custom tool calls and their
outputs, namespaced calls, reasoning items, merged into the previous assistant message),
``rpartial`` (a last assistant or reasoning item ``in_progress`` / ``incomplete``: continued),
``rflags`` (reasoning effort, template arguments, truncation, limits, stop sequences, request templates
that show what the template is handed, and what vLLM refuses), ``rgrow`` (agent loops re-sent with the
history grown at every turn).

Messages families: ``mplain`` (system as a string or blocks, billing header, cache_control),
``mblocks`` (every content block type: text, image, tool_use, tool_result in its forms, thinking,
redacted thinking, tool_reference), ``mtools`` (schemas without ``type``, ``tools: []``, strict,
defer_loading, tool changes, every ``tool_choice``), ``mflags`` (thinking, effort, stop sequences,
max_tokens, template arguments, refusals), ``mgrow`` (agent loops).
"""

from __future__ import annotations

import copy
import json
from typing import Any

from tests.support.parity_corpus import Case, _Gen

Body = dict[str, Any]

# A template (sent in chat_template_kwargs) that prints what vLLM hands the template, keys in order.
SHOW_TEMPLATE = (
    "{{ messages | tojson }}|{{ tools | tojson }}|{{ add_generation_prompt }}|{{ reasoning_effort }}"
    "|{{ enable_thinking }}|{{ x_var }}"
)
SHOW_PARTS_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}:{% for c in m.content %}<{{ c | tojson }}>{% endfor %};{% endfor %}"
)

_SCHEMA = {
    "type": "object",
    "properties": {"path": {"type": "string", "description": "a path"}, "n": {"type": "integer"}},
    "required": ["path"],
}


def _copy(body: Body) -> Body:
    return copy.deepcopy(body)


# -- Responses ---------------------------------------------------------------------------------------------


class _R:
    """Responses item and tool builders over the shared text generator."""

    def __init__(self, g: _Gen) -> None:
        self.g = g

    def user(self, parts: bool = False) -> dict[str, Any]:
        g = self.g
        if parts:
            content: Any = [{"type": "input_text", "text": g.text(1, 12)} for _ in range(g.r.randint(1, 3))]
        else:
            content = g.text(1, 20)
        item: dict[str, Any] = {"role": "user", "content": content}
        if g.r.random() < 0.5:
            item["type"] = "message"
        return item

    def assistant(self, status: str | None = "completed", text: str | None = None) -> dict[str, Any]:
        item: dict[str, Any] = {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": text if text is not None else self.g.text(1, 15)}],
        }
        if status is not None:
            item["status"] = status
        if self.g.r.random() < 0.5:
            item["id"] = f"msg_{self.g.r.randrange(10**6)}"
        if self.g.r.random() < 0.3:
            item["content"][0]["annotations"] = []
        return item

    def call(self, cid: str, name: str = "read_file", ns: str | None = None) -> dict[str, Any]:
        g = self.g
        item: dict[str, Any] = {
            "type": "function_call",
            "call_id": cid,
            "name": name,
            "arguments": json.dumps({"path": g.text(1, 3, 0.0)}, ensure_ascii=g.r.random() < 0.5),
        }
        if ns is not None:
            item["namespace"] = ns
        if g.r.random() < 0.4:
            item["id"] = f"fc_{g.r.randrange(10**6)}"
        if g.r.random() < 0.3:
            item["status"] = g.r.choice(["completed", "in_progress", "incomplete"])
        return item

    def output(self, cid: str) -> dict[str, Any]:
        g = self.g
        out: Any = g.text(1, 30, 0.03)
        if g.r.random() < 0.2:
            out = [{"type": "input_text", "text": g.text(1, 8)} for _ in range(2)]
        item: dict[str, Any] = {"type": "function_call_output", "call_id": cid, "output": out}
        if g.r.random() < 0.3:
            item["id"] = f"fco_{g.r.randrange(10**6)}"
        if g.r.random() < 0.2:
            item["status"] = "completed"
        return item

    def reasoning(self, content: bool | None = None) -> dict[str, Any]:
        g = self.g
        item: dict[str, Any] = {
            "type": "reasoning",
            "summary": [{"type": "summary_text", "text": g.text(1, 8)}] if g.r.random() < 0.8 else [],
        }
        if content if content is not None else g.r.random() < 0.5:
            item["content"] = [{"type": "reasoning_text", "text": g.text(1, 10)}]
        if g.r.random() < 0.5:
            item["id"] = f"rs_{g.r.randrange(10**6)}"
        return item

    def fn_tool(self, name: str) -> dict[str, Any]:
        g = self.g
        tool: dict[str, Any] = {"type": "function", "name": name}
        if g.r.random() < 0.7:
            tool["description"] = g.text(1, 8, 0.0)
        r = g.r.random()
        if r < 0.7:
            tool["parameters"] = _copy(_SCHEMA)
        elif r < 0.8:
            tool["parameters"] = None
        if g.r.random() < 0.6:
            tool["strict"] = g.r.choice([True, False, None])
        if g.r.random() < 0.1:
            tool["defer_loading"] = g.r.choice([True, False])
        return tool


_BUILTINS: list[dict[str, Any]] = [
    {"type": "web_search_preview"},
    {"type": "web_search"},
    {"type": "file_search", "vector_store_ids": ["vs_1"]},
    {"type": "code_interpreter", "container": {"type": "auto"}},
    {"type": "image_generation"},
    {"type": "local_shell"},
    {"type": "mcp", "server_label": "deepwiki", "server_url": "http://127.0.0.1:9/mcp"},
    {"type": "computer_use_preview", "display_width": 800, "display_height": 600, "environment": "linux"},
    {"type": "shell"},
    {"type": "apply_patch"},
]

# Input items of every other type the protocol knows (most are refused: vLLM renders none of them).
_OTHER_ITEMS: list[dict[str, Any]] = [
    {"type": "item_reference", "id": "msg_1"},
    {
        "id": "ws_1",
        "type": "web_search_call",
        "status": "completed",
        "action": {"type": "search", "query": "q"},
    },
    {"id": "fs_1", "type": "file_search_call", "status": "completed", "queries": ["q"]},
    {
        "id": "cc_1",
        "type": "computer_call",
        "call_id": "c1",
        "action": {"type": "click", "button": "left", "x": 1, "y": 2},
        "pending_safety_checks": [],
        "status": "completed",
    },
    {
        "type": "computer_call_output",
        "call_id": "c1",
        "output": {"type": "computer_screenshot", "image_url": "x"},
    },
    {"id": "ig_1", "type": "image_generation_call", "status": "completed", "result": None},
    {"id": "ci_1", "type": "code_interpreter_call", "status": "completed", "code": "1", "container_id": "c"},
    {
        "id": "ls_1",
        "type": "local_shell_call",
        "call_id": "c2",
        "status": "completed",
        "action": {"type": "exec", "command": ["ls"], "env": {}},
    },
    {"type": "local_shell_call_output", "id": "c2", "output": "a.py"},
    {"type": "mcp_list_tools", "id": "ml_1", "server_label": "s", "tools": []},
    {"type": "mcp_approval_request", "id": "ma_1", "server_label": "s", "name": "n", "arguments": "{}"},
    {"type": "mcp_approval_response", "approval_request_id": "ma_1", "approve": True},
    {"type": "mcp_call", "id": "mc_1", "server_label": "s", "name": "n", "arguments": "{}"},
    {"type": "custom_tool_call_output", "call_id": "c9", "output": "done"},
    {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}],
    },
    {"type": "message", "role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]},
    {"type": "unknown_item", "x": 1},
    {"content": "no role"},
    "a bare string",
]


def _responses_strings(g: _Gen, r: _R) -> list[Case]:
    out = []
    long = "\n".join(g.text(30, 60, 0.02) for _ in range(12))
    for i in range(24):
        body: Body = {"input": g.text(1, 40) if i % 4 else g.script_text()}
        style = i % 6
        if style == 1:
            body["instructions"] = g.text(1, 30)
        elif style == 2:
            body["instructions"] = ""
        elif style == 3:
            body["instructions"] = None
        elif style == 4:
            body["instructions"] = long
        out.append(Case(f"rstr-{i:03d}", body))
    out += [
        Case("rstr-empty", {"input": ""}),
        Case("rstr-whitespace", {"input": " \n\t "}),
        Case("rstr-controls", {"input": g.text(5, 20, 0.5), "instructions": g.text(3, 10, 0.5)}),
        Case("rstr-empty-list", {"input": []}),
        Case("rstr-empty-list-instructions", {"input": [], "instructions": "only this"}),
        Case("rstr-missing", {"instructions": "x"}),
        Case("rstr-null", {"input": None}),
        Case("rstr-number", {"input": 7}),
        Case("rstr-object", {"input": {"role": "user", "content": "x"}}),
    ]
    return out


def _responses_items(g: _Gen, r: _R) -> list[Case]:
    out = []
    for i in range(30):
        items: list[Any] = []
        if i % 3 == 0:
            items.append({"role": g.r.choice(["system", "developer"]), "content": g.text(1, 10)})
        for _ in range(g.r.randint(1, 3)):
            items.append(r.user(parts=g.r.random() < 0.4))
            if g.r.random() < 0.6:
                items.append(
                    r.assistant() if g.r.random() < 0.6 else {"role": "assistant", "content": g.text(1, 10)}
                )
        items.append(r.user())
        body: Body = {"input": items}
        if i % 2:
            body["instructions"] = g.text(1, 10)
        out.append(Case(f"ritems-{i:03d}", body))
    # one of each shape
    t = g.text
    shapes: list[tuple[str, list[Any]]] = [
        ("user-str", [{"role": "user", "content": t(1, 5)}]),
        ("user-typed", [{"type": "message", "role": "user", "content": t(1, 5)}]),
        (
            "user-status",
            [
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "a"}],
                    "status": "completed",
                }
            ],
        ),
        ("user-status-str", [{"role": "user", "content": "a", "status": "in_progress"}]),
        (
            "user-parts",
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": t(1, 4)},
                        {"type": "input_text", "text": ""},
                        {"type": "input_text", "text": t(1, 4)},
                    ],
                }
            ],
        ),
        (
            "user-extra-keys",
            [{"role": "user", "content": "Hi", "name": "bob", "id": "x1", "x_extra": {"a": 1}}],
        ),
        (
            "user-part-extra",
            [
                {
                    "role": "user",
                    "content": [{"type": "input_text", "text": "a", "cache_control": {"type": "ephemeral"}}],
                }
            ],
        ),
        ("user-text-part", [{"role": "user", "content": [{"type": "text", "text": "chat style"}]}]),
        ("user-output-text-part", [{"role": "user", "content": [{"type": "output_text", "text": "o"}]}]),
        ("user-empty-parts", [{"role": "user", "content": []}]),
        ("user-null-content", [{"role": "user", "content": None}]),
        ("user-phase", [{"role": "user", "content": "p", "phase": "commentary"}]),
        (
            "system-parts",
            [
                {
                    "role": "system",
                    "content": [{"type": "input_text", "text": "s1"}, {"type": "input_text", "text": "s2"}],
                },
                {"role": "user", "content": "q"},
            ],
        ),
        (
            "system-late",
            [
                {"role": "user", "content": "q"},
                {"role": "system", "content": "late"},
                {"role": "user", "content": "q2"},
            ],
        ),
        (
            "system-billing",
            [
                {"role": "system", "content": "x-anthropic-billing-header: cch=1;\nrest"},
                {"role": "user", "content": "q"},
            ],
        ),
        ("developer", [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Q"}]),
        (
            "developer-parts",
            [
                {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "d"}]},
                {"role": "user", "content": "Q"},
            ],
        ),
        (
            "assistant-str",
            [
                {"role": "user", "content": "Q"},
                {"role": "assistant", "content": "A"},
                {"role": "user", "content": "Q2"},
            ],
        ),
        (
            "assistant-str-typed",
            [
                {"role": "user", "content": "Q"},
                {"type": "message", "role": "assistant", "content": "A"},
                {"role": "user", "content": "Q2"},
            ],
        ),
        (
            "assistant-output",
            [{"role": "user", "content": "Q"}, r.assistant(), {"role": "user", "content": "Q2"}],
        ),
        (
            "assistant-no-type",
            [
                {"role": "user", "content": "Q"},
                {"role": "assistant", "content": [{"type": "output_text", "text": "A"}]},
                {"role": "user", "content": "Q2"},
            ],
        ),
        (
            "assistant-input-text",
            [
                {"role": "user", "content": "Q"},
                {"role": "assistant", "content": [{"type": "input_text", "text": "A"}]},
                {"role": "user", "content": "Q2"},
            ],
        ),
        (
            "assistant-two-parts",
            [
                {"role": "user", "content": "Q"},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [
                        {"type": "output_text", "text": "first"},
                        {"type": "output_text", "text": "second"},
                    ],
                },
                {"role": "user", "content": "Q2"},
            ],
        ),
        (
            "assistant-refusal",
            [
                {"role": "user", "content": "Q"},
                {"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
                {"role": "user", "content": "Q2"},
            ],
        ),
        (
            "assistant-text-then-refusal",
            [
                {"role": "user", "content": "Q"},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "a"}, {"type": "refusal", "refusal": "no"}],
                },
                {"role": "user", "content": "Q2"},
            ],
        ),
        (
            "assistant-empty-parts",
            [
                {"role": "user", "content": "Q"},
                {"type": "message", "role": "assistant", "content": []},
                {"role": "user", "content": "Q2"},
            ],
        ),
        (
            "assistant-logprobs",
            [
                {"role": "user", "content": "Q"},
                {
                    "type": "message",
                    "role": "assistant",
                    "id": "m1",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": "A", "annotations": [], "logprobs": []}],
                },
                {"role": "user", "content": "Q2"},
            ],
        ),
        (
            "assistant-phase",
            [
                {"role": "user", "content": "Q"},
                {
                    "type": "message",
                    "role": "assistant",
                    "phase": "final_answer",
                    "content": [{"type": "output_text", "text": "A"}],
                },
                {"role": "user", "content": "Q2"},
            ],
        ),
        (
            "assistant-two-in-a-row",
            [
                {"role": "user", "content": "Q"},
                r.assistant(),
                r.assistant(),
                {"role": "user", "content": "Q2"},
            ],
        ),
        ("assistant-last-completed", [{"role": "user", "content": "Q"}, r.assistant("completed")]),
        (
            "assistant-last-str",
            [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "The answer is"}],
        ),
        ("tool-role-item", [{"role": "user", "content": "Q"}, {"role": "tool", "content": "r"}]),
        ("unknown-role", [{"role": "critic", "content": "hmm"}, {"role": "user", "content": "Q"}]),
    ]
    out += [Case(f"ritems-{name}", {"input": items}) for name, items in shapes]
    for i, item in enumerate(_OTHER_ITEMS):
        out.append(Case(f"ritems-other-{i:02d}", {"input": [{"role": "user", "content": "q"}, item]}))
    return out


def _responses_tools(g: _Gen, r: _R) -> list[Case]:
    out = []
    choices: list[Any] = [
        None,
        "none",
        "auto",
        "required",
        {"type": "function", "name": "read_file"},
        {"type": "function", "name": "missing"},
    ]
    for i in range(36):
        tools: list[dict[str, Any]] = [r.fn_tool("read_file")]
        kind = i % 6
        if kind == 1:
            tools.append({"type": "custom", "name": "apply_patch_text", "description": g.text(1, 6, 0.0)})
        elif kind == 2:
            tools.append(
                {
                    "type": "namespace",
                    "name": "fs",
                    "description": g.text(1, 5, 0.0),
                    "tools": [r.fn_tool("write"), r.fn_tool("list")],
                }
            )
        elif kind == 3:
            tools.append(_copy(g.r.choice(_BUILTINS)))
        elif kind == 4:
            tools.append(r.fn_tool("search"))
        body: Body = {"input": g.text(1, 20), "tools": tools}
        choice = choices[(i // 6) % len(choices)]
        if choice is not None:
            body["tool_choice"] = choice
        if i % 5 == 0:
            body["instructions"] = g.text(1, 10)
        out.append(Case(f"rtools-{i:03d}", body))
    fn = r.fn_tool("read_file")
    ns = {"type": "namespace", "name": "fs", "description": "files", "tools": [_copy(fn)]}
    special: list[tuple[str, Body]] = [
        ("empty", {"input": "x", "tools": []}),
        ("empty-choice-auto", {"input": "x", "tools": [], "tool_choice": "auto"}),
        ("empty-choice-required", {"input": "x", "tools": [], "tool_choice": "required"}),
        ("empty-choice-named", {"input": "x", "tools": [], "tool_choice": {"type": "function", "name": "f"}}),
        ("null", {"input": "x", "tools": None}),
        ("no-params", {"input": "x", "tools": [{"type": "function", "name": "noparams"}]}),
        (
            "null-desc",
            {
                "input": "x",
                "tools": [{"type": "function", "name": "f", "description": None, "parameters": None}],
            },
        ),
        ("strict", {"input": "x", "tools": [{**fn, "strict": True}]}),
        ("defer", {"input": "x", "tools": [{**fn, "defer_loading": True}]}),
        (
            "extra-key",
            {"input": "x", "tools": [{**fn, "x_extra": 1, "cache_control": {"type": "ephemeral"}}]},
        ),
        (
            "schema-no-type",
            {"input": "x", "tools": [{**fn, "parameters": {"properties": {"a": {"type": "string"}}}}]},
        ),
        ("no-name", {"input": "x", "tools": [{"type": "function", "parameters": {}}]}),
        ("no-type", {"input": "x", "tools": [{"name": "f", "parameters": {}}]}),
        (
            "chat-shape",
            {"input": "x", "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
        ),
        (
            "custom",
            {"input": "x", "tools": [{"type": "custom", "name": "patch", "description": "apply a patch"}]},
        ),
        ("custom-no-desc", {"input": "x", "tools": [{"type": "custom", "name": "patch"}]}),
        (
            "custom-text-format",
            {"input": "x", "tools": [{"type": "custom", "name": "patch", "format": {"type": "text"}}]},
        ),
        (
            "custom-grammar",
            {
                "input": "x",
                "tools": [
                    {
                        "type": "custom",
                        "name": "p",
                        "format": {"type": "grammar", "syntax": "lark", "definition": "start: /a/"},
                    }
                ],
            },
        ),
        ("namespace", {"input": "x", "tools": [ns]}),
        (
            "namespace-custom-member",
            {"input": "x", "tools": [{**ns, "tools": [_copy(fn), {"type": "custom", "name": "c"}]}]},
        ),
        ("namespace-empty", {"input": "x", "tools": [{**ns, "tools": []}]}),
        (
            "namespace-choice-local",
            {"input": "x", "tools": [ns], "tool_choice": {"type": "function", "name": "read_file"}},
        ),
        (
            "namespace-choice-flat",
            {"input": "x", "tools": [ns], "tool_choice": {"type": "function", "name": "fs__read_file"}},
        ),
        (
            "namespace-choice-ambiguous",
            {
                "input": "x",
                "tools": [ns, {**ns, "name": "fs2"}],
                "tool_choice": {"type": "function", "name": "read_file"},
            },
        ),
        ("builtins-only", {"input": "x", "tools": [_copy(b) for b in _BUILTINS[:3]]}),
        ("builtin-and-function", {"input": "x", "tools": [_copy(_BUILTINS[0]), _copy(fn)]}),
        (
            "builtin-choice",
            {
                "input": "x",
                "tools": [_copy(_BUILTINS[0]), _copy(fn)],
                "tool_choice": {"type": "web_search_preview"},
            },
        ),
        (
            "allowed-tools-choice",
            {
                "input": "x",
                "tools": [_copy(fn)],
                "tool_choice": {
                    "type": "allowed_tools",
                    "mode": "auto",
                    "tools": [{"type": "function", "name": "read_file"}],
                },
            },
        ),
        (
            "custom-choice",
            {
                "input": "x",
                "tools": [{"type": "custom", "name": "patch"}],
                "tool_choice": {"type": "custom", "name": "patch"},
            },
        ),
        ("choice-none-with-tools", {"input": "x", "tools": [_copy(fn)], "tool_choice": "none"}),
        ("choice-bad-string", {"input": "x", "tools": [_copy(fn)], "tool_choice": "sometimes"}),
        ("unknown-tool-type", {"input": "x", "tools": [{"type": "teleport"}]}),
        ("many", {"input": "x", "tools": [r.fn_tool(f"tool_{k}") for k in range(8)]}),
    ]
    out += [Case(f"rtools-{name}", body) for name, body in special]
    return out


def _responses_calls(g: _Gen, r: _R) -> list[Case]:
    out = []
    fn = r.fn_tool("read_file")
    for i in range(40):
        items: list[Any] = [r.user()]
        for turn in range(g.r.randint(1, 3)):
            cid = f"call_{i}_{turn}"
            if g.r.random() < 0.4:
                items.append(r.reasoning())
            if g.r.random() < 0.4:
                items.append(r.assistant())
            ncalls = 1 + (g.r.random() < 0.3)
            ns = "fs" if i % 7 == 3 else None
            for k in range(ncalls):
                items.append(r.call(f"{cid}_{k}", ns=ns))
            for k in range(ncalls):
                items.append(r.output(f"{cid}_{k}"))
        if g.r.random() < 0.5:
            items.append(r.user())
        body: Body = {"input": items, "tools": [_copy(fn)]}
        if i % 7 == 3:
            body["tools"].append(
                {"type": "namespace", "name": "fs", "description": "d", "tools": [_copy(fn)]}
            )
        if i % 3 == 0:
            body["instructions"] = g.text(1, 10)
        out.append(Case(f"rcalls-{i:03d}", body))
    call = {
        "type": "function_call",
        "call_id": "call_1",
        "name": "read_file",
        "arguments": '{"path": "a.py"}',
    }
    res = {"type": "function_call_output", "call_id": "call_1", "output": "print(1)"}
    q = {"role": "user", "content": "go"}
    special: list[tuple[str, list[Any]]] = [
        ("call-first", [call, res]),
        ("call-after-user", [q, call, res]),
        ("call-bad-args", [q, {**call, "arguments": "{not json"}, res]),
        ("call-args-array", [q, {**call, "arguments": "[1, 2]"}, res]),
        ("call-args-empty", [q, {**call, "arguments": ""}, res]),
        ("call-args-object", [q, {**call, "arguments": {"path": "a"}}, res]),
        ("call-no-call-id", [q, {k: v for k, v in call.items() if k != "call_id"}, res]),
        ("call-no-name", [q, {k: v for k, v in call.items() if k != "name"}, res]),
        ("call-namespace", [q, {**call, "namespace": "fs"}, res]),
        ("call-namespace-null", [q, {**call, "namespace": None}, res]),
        ("call-namespace-empty", [q, {**call, "namespace": ""}, res]),
        ("call-extra", [q, {**call, "x_extra": 1}, res]),
        (
            "output-list",
            [
                q,
                call,
                {
                    **res,
                    "output": [{"type": "input_text", "text": "l1"}, {"type": "input_text", "text": "l2"}],
                },
            ],
        ),
        (
            "output-image",
            [q, call, {**res, "output": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}]}],
        ),
        ("output-empty", [q, call, {**res, "output": ""}]),
        ("output-null", [q, call, {**res, "output": None}]),
        ("output-number", [q, call, {**res, "output": 42}]),
        ("output-no-call-id", [q, call, {k: v for k, v in res.items() if k != "call_id"}]),
        ("output-alone", [q, res]),
        ("assistant-then-call", [q, r.assistant(), call, res]),
        ("assistant-str-then-call", [q, {"role": "assistant", "content": "let me look"}, call, res]),
        ("two-calls", [q, call, {**call, "call_id": "call_2"}, res, {**res, "call_id": "call_2"}]),
        ("call-output-call", [q, call, res, {**call, "call_id": "call_2"}, {**res, "call_id": "call_2"}]),
        ("call-then-assistant", [q, call, r.assistant(), res]),
        ("reasoning-then-call", [q, r.reasoning(), call, res]),
        ("reasoning-content", [q, r.reasoning(True), r.assistant(), q]),
        (
            "reasoning-summary-only",
            [q, {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}]}, r.assistant(), q],
        ),
        ("reasoning-empty", [q, {"type": "reasoning", "summary": []}, r.assistant(), q]),
        (
            "reasoning-two-summaries",
            [
                q,
                {
                    "type": "reasoning",
                    "summary": [
                        {"type": "summary_text", "text": "s1"},
                        {"type": "summary_text", "text": "s2"},
                    ],
                },
                q,
            ],
        ),
        ("reasoning-two", [q, r.reasoning(True), r.reasoning(True), r.assistant(), q]),
        ("reasoning-after-assistant", [q, r.assistant(), r.reasoning(True), q]),
        ("reasoning-alone", [r.reasoning(True), q]),
        ("reasoning-encrypted", [q, {**r.reasoning(), "encrypted_content": "xx"}]),
        ("reasoning-encrypted-null", [q, {**r.reasoning(True), "encrypted_content": None}, q]),
        (
            "reasoning-no-summary",
            [q, {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "r"}]}, q],
        ),
        ("reasoning-status", [q, {**r.reasoning(True), "status": "completed"}, r.assistant(), q]),
        (
            "custom-call",
            [
                q,
                {"type": "custom_tool_call", "call_id": "c9", "name": "patch", "input": "diff --git ü"},
                {"type": "custom_tool_call_output", "call_id": "c9", "output": "ok"},
            ],
        ),
        (
            "custom-call-empty-input",
            [
                q,
                {"type": "custom_tool_call", "call_id": "c9", "name": "patch", "input": ""},
                {"type": "custom_tool_call_output", "call_id": "c9", "output": "ok"},
            ],
        ),
        (
            "custom-call-id",
            [
                q,
                {"type": "custom_tool_call", "id": "ctc_1", "call_id": "c9", "name": "patch", "input": "x"},
                {
                    "type": "custom_tool_call_output",
                    "call_id": "c9",
                    "output": [{"type": "input_text", "text": "ok"}],
                },
            ],
        ),
        ("custom-call-no-input", [q, {"type": "custom_tool_call", "call_id": "c9", "name": "patch"}]),
        (
            "mixed-calls",
            [
                q,
                r.reasoning(True),
                call,
                {"type": "custom_tool_call", "call_id": "c9", "name": "patch", "input": "x"},
                res,
                {"type": "custom_tool_call_output", "call_id": "c9", "output": "ok"},
            ],
        ),
    ]
    tools = [_copy(fn), {"type": "custom", "name": "patch"}]
    out += [Case(f"rcalls-{name}", {"input": items, "tools": tools}) for name, items in special]
    return out


def _responses_partial(g: _Gen, r: _R) -> list[Case]:
    out = []
    q = {"role": "user", "content": "Count to ten"}
    statuses = ["in_progress", "incomplete", "completed", None]
    for i, status in enumerate(statuses):
        out.append(Case(f"rpartial-assistant-{i}", {"input": [q, r.assistant(status, "One, two,")]}))
        reasoning = {**r.reasoning(True)}
        if status is not None:
            reasoning["status"] = status
        out.append(Case(f"rpartial-reasoning-{i}", {"input": [q, reasoning]}))
        out.append(
            Case(
                f"rpartial-str-{i}",
                {"input": [q, {"role": "assistant", "content": "One,", "status": status}]},
            )
        )
        out.append(
            Case(
                f"rpartial-typed-str-{i}",
                {"input": [q, {"type": "message", "role": "assistant", "content": "One,", "status": status}]},
            )
        )
        out.append(Case(f"rpartial-user-{i}", {"input": [{**q, "type": "message", "status": status}]}))
    out += [
        Case(
            "rpartial-reasoning-then-partial",
            {"input": [q, r.reasoning(True), r.assistant("incomplete", "One")]},
        ),
        Case("rpartial-call-last", {"input": [q, {**r.call("c1"), "status": "in_progress"}]}),
        Case(
            "rpartial-kwargs-agp",
            {
                "input": [q, r.assistant("incomplete")],
                "chat_template_kwargs": {"add_generation_prompt": True},
            },
        ),
        Case("rpartial-empty-text", {"input": [q, r.assistant("incomplete", "")]}),
        Case("rpartial-trailing-space", {"input": [q, r.assistant("incomplete", "One, two, ")]}),
    ]
    for i in range(10):
        items = [r.user(), r.assistant(), r.user(), r.assistant(g.r.choice(["incomplete", "in_progress"]))]
        out.append(Case(f"rpartial-{i:03d}", {"input": items, "instructions": g.text(1, 8)}))
    return out


def _responses_flags(g: _Gen, r: _R) -> list[Case]:
    q = g.text(1, 10)
    long = g.text(3000, 3200, 0.0)
    fn = r.fn_tool("read_file")
    bodies: list[tuple[str, Body]] = [
        *[
            (f"effort-{e}", {"input": q, "reasoning": {"effort": e}})
            for e in ("none", "minimal", "low", "medium", "high", "xhigh", "max")
        ],
        ("effort-null", {"input": q, "reasoning": {"effort": None}}),
        ("effort-summary", {"input": q, "reasoning": {"effort": "low", "summary": "auto"}}),
        ("effort-bad", {"input": q, "reasoning": {"effort": "extreme"}}),
        (
            "effort-kwargs",
            {"input": q, "reasoning": {"effort": "high"}, "chat_template_kwargs": {"enable_thinking": False}},
        ),
        (
            "effort-kwargs-null",
            {"input": q, "reasoning": {"effort": "high"}, "chat_template_kwargs": {"enable_thinking": None}},
        ),
        ("kwargs-thinking-off", {"input": q, "chat_template_kwargs": {"enable_thinking": False}}),
        ("kwargs-thinking-on", {"input": q, "chat_template_kwargs": {"enable_thinking": True}}),
        ("kwargs-agp-false", {"input": q, "chat_template_kwargs": {"add_generation_prompt": False}}),
        ("kwargs-var", {"input": q, "chat_template_kwargs": {"x_var": "X", "unknown": 1}}),
        ("kwargs-auto", {"input": q, "chat_template_kwargs": {"enable_thinking": "auto"}}),
        (
            "kwargs-tools",
            {
                "input": q,
                "tools": [_copy(fn)],
                "chat_template_kwargs": {"tools": [{"type": "function", "function": {"name": "kw"}}]},
            },
        ),
        ("kwargs-effort", {"input": q, "chat_template_kwargs": {"reasoning_effort": "low"}}),
        ("kwargs-not-object", {"input": q, "chat_template_kwargs": [1]}),
        ("kwargs-conversation", {"input": q, "chat_template_kwargs": {"conversation": []}}),
        ("kwargs-tokenize", {"input": q, "chat_template_kwargs": {"tokenize": True}}),
        ("truncation-auto", {"input": q, "truncation": "auto"}),
        ("truncation-disabled", {"input": q, "truncation": "disabled"}),
        ("truncation-bad", {"input": q, "truncation": "sometimes"}),
        ("truncation-auto-long", {"input": long, "truncation": "auto"}),
        ("too-long", {"input": long}),
        ("max-output", {"input": q, "max_output_tokens": 16}),
        ("max-output-huge", {"input": q, "max_output_tokens": 10**6}),
        ("stop", {"input": q, "stop": ["\n\n", "END"]}),
        ("stop-str", {"input": q, "stop": "END"}),
        ("sampling", {"input": q, "temperature": 0.2, "top_p": 0.9, "top_k": 5, "seed": 1}),
        ("stream", {"input": q, "stream": True}),
        ("store-false", {"input": q, "store": False}),
        ("background", {"input": q, "background": True, "store": False}),
        ("metadata", {"input": q, "metadata": {"k": "v"}, "user": "u", "prompt_cache_key": "k"}),
        ("text-format", {"input": q, "text": {"format": {"type": "json_object"}}}),
        ("include", {"input": q, "include": ["reasoning.encrypted_content"]}),
        ("cache-salt", {"input": q, "cache_salt": "salty"}),
        ("cache-salt-empty", {"input": q, "cache_salt": ""}),
        ("previous-response", {"input": q, "previous_response_id": "resp_1"}),
        ("prompt", {"input": q, "prompt": {"id": "pmpt_1"}}),
        (
            "previous-input-messages",
            {"input": q, "previous_input_messages": [{"role": "user", "content": "old"}]},
        ),
        ("kv-ids", {"input": q, "kv_transfer_params": {"prompt_token_ids": [1, 2, 3]}}),
        ("kv-ids-bad", {"input": q, "kv_transfer_params": {"prompt_token_ids": [-1]}}),
        ("mm-kwargs", {"input": q, "mm_processor_kwargs": {"a": 1}}),
        (
            "show",
            {
                "input": [
                    {"role": "developer", "content": "d"},
                    r.user(True),
                    r.assistant(),
                    r.call("c1"),
                    r.output("c1"),
                ],
                "tools": [_copy(fn), {"type": "custom", "name": "patch"}],
                "chat_template_kwargs": {"chat_template": SHOW_TEMPLATE, "x_var": "X"},
            },
        ),
        (
            "show-parts",
            {
                "input": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "a", "cache_control": {"type": "ephemeral"}}
                        ],
                    },
                    r.assistant(),
                    {"role": "user", "content": "b"},
                ],
                "chat_template_kwargs": {"chat_template": SHOW_PARTS_TEMPLATE},
            },
        ),
        (
            "show-tools",
            {
                "input": q,
                "tools": [
                    _copy(fn),
                    {**fn, "name": "f2", "strict": True, "defer_loading": True, "x_extra": 1},
                    {"type": "custom", "name": "patch", "description": "d"},
                    {"type": "namespace", "name": "ns", "description": "d", "tools": [_copy(fn)]},
                ],
                "chat_template_kwargs": {"chat_template": SHOW_TEMPLATE},
            },
        ),
        (
            "show-effort",
            {
                "input": q,
                "reasoning": {"effort": "low"},
                "chat_template_kwargs": {"chat_template": SHOW_TEMPLATE},
            },
        ),
        (
            "show-partial",
            {
                "input": [r.user(), r.assistant("incomplete", "half")],
                "chat_template_kwargs": {"chat_template": SHOW_TEMPLATE},
            },
        ),
        (
            "show-reasoning",
            {
                "input": [
                    r.user(),
                    r.reasoning(True),
                    r.call("c1"),
                    r.output("c1"),
                    r.reasoning(False),
                    r.assistant(),
                ],
                "chat_template_kwargs": {"chat_template": SHOW_TEMPLATE},
            },
        ),
        (
            "show-items",
            {
                "input": [
                    {"role": "user", "content": "a", "name": "n", "type": "message", "status": "completed"},
                    {
                        "role": "system",
                        "content": [{"type": "input_text", "text": "s"}],
                        "status": "completed",
                    },
                ],
                "chat_template_kwargs": {"chat_template": SHOW_TEMPLATE},
            },
        ),
        (
            "show-custom",
            {
                "input": [
                    r.user(),
                    {"type": "custom_tool_call", "call_id": "c9", "name": "patch", "input": 'ü "q"'},
                    {"type": "custom_tool_call_output", "call_id": "c9", "output": "ok"},
                ],
                "tools": [{"type": "custom", "name": "patch"}],
                "chat_template_kwargs": {"chat_template": SHOW_TEMPLATE},
            },
        ),
        (
            "show-output-list",
            {
                "input": [
                    r.user(),
                    r.call("c1"),
                    {
                        "type": "function_call_output",
                        "call_id": "c1",
                        "output": [
                            {"type": "input_text", "text": "l1"},
                            {"type": "input_text", "text": "l2"},
                        ],
                    },
                ],
                "chat_template_kwargs": {"chat_template": SHOW_TEMPLATE},
            },
        ),
    ]
    return [Case(f"rflags-{name}", body) for name, body in bodies]


_AGENT_INSTRUCTIONS = (
    "You are a coding agent in a repository. Read before you edit, keep changes small, run the tests "
    "after each change and report failures verbatim.\n"
)


def _responses_grow(g: _Gen, r: _R, conversations: int, turns: int) -> list[Case]:
    out = []
    for c in range(conversations):
        instructions = _AGENT_INSTRUCTIONS + g.text(10, 40, 0.02)
        tools: list[dict[str, Any]] = [r.fn_tool("read_file"), r.fn_tool("run_tests")]
        if c % 3 == 1:
            tools.append({"type": "custom", "name": "apply_patch"})
        if c % 4 == 2:
            tools.append({"type": "web_search_preview"})
        items: list[Any] = []
        for t in range(turns):
            items.append(r.user(parts=c % 2 == 1))
            body: Body = {"input": _copy(items), "tools": tools, "instructions": instructions}
            if c % 5 == 4:
                body["reasoning"] = {"effort": "low"}
            out.append(Case(f"rgrow-{c:02d}-{t:02d}", body))
            for k in range(g.r.randint(0, 2)):
                cid = f"call_{c}_{t}_{k}"
                if c % 2 == 0:
                    items.append(r.reasoning(True))
                if c % 3 == 1 and k == 1:
                    items.append(
                        {
                            "type": "custom_tool_call",
                            "call_id": cid,
                            "name": "apply_patch",
                            "input": g.text(2, 10),
                        }
                    )
                    items.append({"type": "custom_tool_call_output", "call_id": cid, "output": "applied"})
                else:
                    items.append(r.call(cid))
                    items.append(r.output(cid))
            items.append(r.assistant())
    return out


# -- Messages ----------------------------------------------------------------------------------------------


class _M:
    def __init__(self, g: _Gen) -> None:
        self.g = g

    def tool(self, name: str) -> dict[str, Any]:
        g = self.g
        schema = _copy(_SCHEMA)
        if g.r.random() < 0.3:
            del schema["type"]
        tool: dict[str, Any] = {"name": name, "input_schema": schema}
        if g.r.random() < 0.7:
            tool["description"] = g.text(1, 8, 0.0)
        if g.r.random() < 0.15:
            tool["strict"] = g.r.choice([True, False])
        if g.r.random() < 0.1:
            tool["defer_loading"] = True
        if g.r.random() < 0.15:
            tool["cache_control"] = {"type": "ephemeral"}
        return tool

    def use(self, tid: str, name: str = "read_file") -> dict[str, Any]:
        return {"type": "tool_use", "id": tid, "name": name, "input": {"path": self.g.text(1, 3, 0.0)}}

    def result(self, tid: str) -> dict[str, Any]:
        g = self.g
        block: dict[str, Any] = {"type": "tool_result", "tool_use_id": tid}
        style = g.r.randrange(5)
        if style == 0:
            block["content"] = g.text(1, 30, 0.03)
        elif style == 1:
            block["content"] = [{"type": "text", "text": g.text(1, 10)} for _ in range(g.r.randint(1, 3))]
        elif style == 2:
            block["content"] = g.text(1, 10)
            block["is_error"] = True
        elif style == 3:
            block["content"] = []
        else:
            block["content"] = [
                {"type": "text", "text": g.text(1, 5), "cache_control": {"type": "ephemeral"}}
            ]
        return block

    def text_blocks(self, n: int) -> list[dict[str, Any]]:
        out = []
        for _ in range(n):
            b: dict[str, Any] = {"type": "text", "text": self.g.text(1, 12)}
            if self.g.r.random() < 0.2:
                b["cache_control"] = {"type": "ephemeral"}
            out.append(b)
        return out


def _messages_plain(g: _Gen, m: _M) -> list[Case]:
    out = []
    for i in range(30):
        msgs: list[dict[str, Any]] = []
        for _ in range(g.r.randint(1, 3)):
            content: Any = g.text(1, 20) if g.r.random() < 0.6 else m.text_blocks(g.r.randint(1, 3))
            msgs.append({"role": "user", "content": content})
            if g.r.random() < 0.7:
                msgs.append(
                    {
                        "role": "assistant",
                        "content": g.text(1, 20) if g.r.random() < 0.5 else m.text_blocks(1),
                    }
                )
        body: Body = {"messages": msgs, "max_tokens": 64}
        style = i % 5
        if style == 1:
            body["system"] = g.text(1, 30)
        elif style == 2:
            body["system"] = m.text_blocks(g.r.randint(1, 3))
        elif style == 3:
            body["system"] = [
                {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=ab;"},
                *m.text_blocks(2),
            ]
        out.append(Case(f"mplain-{i:03d}", body))
    special: list[tuple[str, Body]] = [
        ("system-empty", {"system": "", "messages": [{"role": "user", "content": "q"}]}),
        ("system-null", {"system": None, "messages": [{"role": "user", "content": "q"}]}),
        ("system-empty-blocks", {"system": [], "messages": [{"role": "user", "content": "q"}]}),
        (
            "system-billing-str",
            {
                "system": "x-anthropic-billing-header: cch=1;\nYou are helpful.",
                "messages": [{"role": "user", "content": "q"}],
            },
        ),
        (
            "system-billing-only",
            {
                "system": [{"type": "text", "text": "x-anthropic-billing-header: cch=1;"}],
                "messages": [{"role": "user", "content": "q"}],
            },
        ),
        (
            "system-empty-text-block",
            {
                "system": [{"type": "text", "text": ""}, {"type": "text", "text": "S"}],
                "messages": [{"role": "user", "content": "q"}],
            },
        ),
        (
            "system-image-block",
            {
                "system": [
                    {"type": "image", "source": {"type": "url", "url": "http://x/a.png"}},
                    {"type": "text", "text": "S"},
                ],
                "messages": [{"role": "user", "content": "q"}],
            },
        ),
        (
            "system-tool-use-block",
            {
                "system": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
                "messages": [{"role": "user", "content": "q"}],
            },
        ),
        (
            "system-addition-top",
            {
                "system": [{"type": "tool_addition", "tool": {"type": "tool_reference", "name": "f"}}],
                "messages": [{"role": "user", "content": "q"}],
            },
        ),
        ("user-empty-str", {"messages": [{"role": "user", "content": ""}]}),
        (
            "user-empty-blocks",
            {"messages": [{"role": "user", "content": []}, {"role": "user", "content": "q"}]},
        ),
        (
            "user-empty-text-block",
            {
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": ""}]},
                    {"role": "user", "content": "q"},
                ]
            },
        ),
        (
            "assistant-empty-blocks",
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": []},
                    {"role": "user", "content": "q2"},
                ]
            },
        ),
        (
            "assistant-last",
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "The answer is"},
                ]
            },
        ),
        (
            "assistant-first",
            {"messages": [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "q"}]},
        ),
        ("two-users", {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}),
        (
            "inline-system",
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
            "inline-system-blocks",
            {
                "system": "S1",
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "system", "content": m.text_blocks(2)},
                    {"role": "user", "content": "q2"},
                ],
            },
        ),
        (
            "inline-system-first",
            {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}]},
        ),
        (
            "inline-system-billing",
            {
                "messages": [
                    {"role": "system", "content": "x-anthropic-billing-header: a"},
                    {"role": "user", "content": "q"},
                ]
            },
        ),
        (
            "inline-system-empty",
            {
                "system": "S",
                "messages": [{"role": "system", "content": ""}, {"role": "user", "content": "q"}],
            },
        ),
        ("bad-role", {"messages": [{"role": "tool", "content": "q"}]}),
        ("no-messages", {"messages": []}),
        ("messages-missing", {"system": "s"}),
        ("content-number", {"messages": [{"role": "user", "content": 5}]}),
        ("content-null", {"messages": [{"role": "user", "content": None}]}),
        ("unicode", {"system": "Réponds.", "messages": [{"role": "user", "content": "東京 🚀 naïve"}]}),
        (
            "controls",
            {"system": g.text(2, 6, 0.5), "messages": [{"role": "user", "content": g.text(3, 9, 0.5)}]},
        ),
    ]
    for name, body in special:
        body.setdefault("max_tokens", 64)
        out.append(Case(f"mplain-{name}", body))
    return out


def _messages_blocks(g: _Gen, m: _M) -> list[Case]:
    tool = m.tool("read_file")
    use = m.use("toolu_1")
    q = {"role": "user", "content": "go"}
    res = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "print(1)"}
    think = {"type": "thinking", "thinking": "hmm", "signature": "sig"}
    cases: list[tuple[str, list[dict[str, Any]]]] = [
        ("text-two", [{"role": "user", "content": m.text_blocks(2)}]),
        ("text-one", [{"role": "user", "content": m.text_blocks(1)}]),
        (
            "text-cache-control",
            [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}}],
                }
            ],
        ),
        ("text-null", [{"role": "user", "content": [{"type": "text"}, {"type": "text", "text": "b"}]}]),
        (
            "text-extra",
            [{"role": "user", "content": [{"type": "text", "text": "a", "citations": [], "x": 1}]}],
        ),
        (
            "image-url",
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1/a.png"}},
                        {"type": "text", "text": "what"},
                    ],
                }
            ],
        ),
        (
            "image-base64",
            [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "AA"},
                        }
                    ],
                }
            ],
        ),
        (
            "image-no-source",
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}],
        ),
        (
            "tool-round",
            [
                q,
                {"role": "assistant", "content": [{"type": "text", "text": "Sure."}, use]},
                {"role": "user", "content": [res]},
            ],
        ),
        ("tool-use-only", [q, {"role": "assistant", "content": [use]}, {"role": "user", "content": [res]}]),
        ("tool-use-no-id", [q, {"role": "assistant", "content": [{**use, "id": None}]}]),
        (
            "tool-use-empty-input",
            [q, {"role": "assistant", "content": [{**use, "input": {}}]}, {"role": "user", "content": [res]}],
        ),
        (
            "tool-use-unicode",
            [
                q,
                {"role": "assistant", "content": [{**use, "input": {"q": "東京 ü"}}]},
                {"role": "user", "content": [res]},
            ],
        ),
        (
            "tool-use-nested",
            [
                q,
                {"role": "assistant", "content": [{**use, "input": {"a": {"b": [1, 2.5, None, True]}}}]},
                {"role": "user", "content": [res]},
            ],
        ),
        ("tool-use-input-list", [q, {"role": "assistant", "content": [{**use, "input": [1]}]}]),
        (
            "tool-use-two",
            [
                q,
                {"role": "assistant", "content": [use, {**use, "id": "toolu_2"}]},
                {"role": "user", "content": [res, {**res, "tool_use_id": "toolu_2"}]},
            ],
        ),
        ("tool-use-in-user", [{"role": "user", "content": [use, {"type": "text", "text": "q"}]}]),
        (
            "result-with-text",
            [
                q,
                {"role": "assistant", "content": [use]},
                {"role": "user", "content": [res, {"type": "text", "text": "now summarise"}]},
            ],
        ),
        (
            "text-then-result",
            [
                q,
                {"role": "assistant", "content": [use]},
                {"role": "user", "content": [{"type": "text", "text": "first"}, res]},
            ],
        ),
        (
            "result-blocks",
            [
                q,
                {"role": "assistant", "content": [use]},
                {
                    "role": "user",
                    "content": [
                        {**res, "content": [{"type": "text", "text": "l1"}, {"type": "text", "text": "l2"}]}
                    ],
                },
            ],
        ),
        (
            "result-empty",
            [
                q,
                {"role": "assistant", "content": [use]},
                {"role": "user", "content": [{**res, "content": ""}]},
            ],
        ),
        (
            "result-none",
            [
                q,
                {"role": "assistant", "content": [use]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"}]},
            ],
        ),
        (
            "result-no-id",
            [
                q,
                {"role": "assistant", "content": [use]},
                {"role": "user", "content": [{"type": "tool_result", "content": "x"}]},
            ],
        ),
        (
            "result-error",
            [
                q,
                {"role": "assistant", "content": [use]},
                {"role": "user", "content": [{**res, "is_error": True}]},
            ],
        ),
        (
            "result-image",
            [
                q,
                {"role": "assistant", "content": [use]},
                {
                    "role": "user",
                    "content": [
                        {
                            **res,
                            "content": [
                                {"type": "text", "text": "t"},
                                {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1/a.png"}},
                            ],
                        }
                    ],
                },
            ],
        ),
        (
            "result-tool-reference",
            [
                q,
                {"role": "assistant", "content": [use]},
                {
                    "role": "user",
                    "content": [{**res, "content": [{"type": "tool_reference", "tool_name": "read_file"}]}],
                },
            ],
        ),
        (
            "result-tool-reference-name",
            [
                q,
                {"role": "assistant", "content": [use]},
                {
                    "role": "user",
                    "content": [
                        {
                            **res,
                            "content": [
                                {"type": "text", "text": "see"},
                                {"type": "tool_reference", "name": "read_file"},
                            ],
                        }
                    ],
                },
            ],
        ),
        (
            "result-unknown-item",
            [
                q,
                {"role": "assistant", "content": [use]},
                {
                    "role": "user",
                    "content": [
                        {**res, "content": [{"type": "document", "x": 1}, {"type": "text", "text": "t"}]}
                    ],
                },
            ],
        ),
        (
            "result-in-assistant",
            [
                q,
                {"role": "assistant", "content": [{"type": "text", "text": "a"}, res]},
                {"role": "user", "content": "q2"},
            ],
        ),
        (
            "result-in-assistant-blocks",
            [
                q,
                {"role": "assistant", "content": [{**res, "content": [{"type": "text", "text": "x"}]}]},
                {"role": "user", "content": "q2"},
            ],
        ),
        (
            "result-only-user",
            [
                q,
                {"role": "assistant", "content": [use]},
                {"role": "user", "content": [res]},
                {"role": "assistant", "content": "done"},
            ],
        ),
        (
            "thinking",
            [
                q,
                {"role": "assistant", "content": [think, {"type": "text", "text": "a"}]},
                {"role": "user", "content": "q2"},
            ],
        ),
        (
            "thinking-two",
            [
                q,
                {
                    "role": "assistant",
                    "content": [think, {**think, "thinking": "more"}, {"type": "text", "text": "a"}],
                },
                {"role": "user", "content": "q2"},
            ],
        ),
        (
            "thinking-empty",
            [
                q,
                {"role": "assistant", "content": [{**think, "thinking": ""}, {"type": "text", "text": "a"}]},
                {"role": "user", "content": "q2"},
            ],
        ),
        (
            "thinking-null",
            [
                q,
                {"role": "assistant", "content": [{"type": "thinking"}, {"type": "text", "text": "a"}]},
                {"role": "user", "content": "q2"},
            ],
        ),
        ("thinking-only", [q, {"role": "assistant", "content": [think]}, {"role": "user", "content": "q2"}]),
        (
            "thinking-tool-use",
            [q, {"role": "assistant", "content": [think, use]}, {"role": "user", "content": [res]}],
        ),
        ("thinking-in-user", [{"role": "user", "content": [think, {"type": "text", "text": "q"}]}]),
        (
            "redacted",
            [
                q,
                {
                    "role": "assistant",
                    "content": [{"type": "redacted_thinking", "data": "xx"}, {"type": "text", "text": "a"}],
                },
                {"role": "user", "content": "q2"},
            ],
        ),
        (
            "redacted-only",
            [
                q,
                {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "xx"}]},
                {"role": "user", "content": "q2"},
            ],
        ),
        (
            "tool-reference-top",
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_reference", "tool_name": "read_file"},
                        {"type": "text", "text": "q"},
                    ],
                }
            ],
        ),
        ("unknown-block", [{"role": "user", "content": [{"type": "video", "url": "x"}]}]),
        (
            "document-block",
            [{"role": "user", "content": [{"type": "document", "source": {"type": "text", "data": "d"}}]}],
        ),
        ("block-no-type", [{"role": "user", "content": [{"text": "x"}]}]),
        ("block-text-number", [{"role": "user", "content": [{"type": "text", "text": 5}]}]),
        (
            "addition-in-user",
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "read_file"}}
                    ],
                }
            ],
        ),
    ]
    return [Case(f"mblocks-{n}", {"messages": msgs, "tools": [tool], "max_tokens": 64}) for n, msgs in cases]


def _messages_tools(g: _Gen, m: _M) -> list[Case]:
    out = []
    choices: list[Any] = [
        None,
        {"type": "auto"},
        {"type": "any"},
        {"type": "none"},
        {"type": "tool", "name": "read_file"},
        {"type": "auto", "disable_parallel_tool_use": True},
    ]
    for i in range(36):
        tools = [m.tool("read_file")] + [m.tool(f"t{k}") for k in range(i % 3)]
        body: Body = {
            "messages": [{"role": "user", "content": g.text(1, 20)}],
            "tools": tools,
            "max_tokens": 64,
        }
        choice = choices[(i // 3) % len(choices)]
        if choice is not None:
            body["tool_choice"] = choice
        if i % 4 == 0:
            body["system"] = g.text(1, 10)
        out.append(Case(f"mtools-{i:03d}", body))
    base = {"name": "read_file", "description": "Read a file", "input_schema": _copy(_SCHEMA)}
    q = [{"role": "user", "content": "q"}]
    special: list[tuple[str, Body]] = [
        ("empty", {"messages": q, "tools": []}),
        ("empty-choice-none", {"messages": q, "tools": [], "tool_choice": {"type": "none"}}),
        ("empty-choice-any", {"messages": q, "tools": [], "tool_choice": {"type": "any"}}),
        ("null", {"messages": q, "tools": None}),
        ("no-tools-choice", {"messages": q, "tool_choice": {"type": "auto"}}),
        ("no-tools-choice-tool", {"messages": q, "tool_choice": {"type": "tool", "name": "x"}}),
        (
            "schema-no-type",
            {"messages": q, "tools": [{**base, "input_schema": {"properties": {"a": {"type": "string"}}}}]},
        ),
        ("schema-empty", {"messages": q, "tools": [{**base, "input_schema": {}}]}),
        ("schema-array-type", {"messages": q, "tools": [{**base, "input_schema": {"type": "array"}}]}),
        ("schema-missing", {"messages": q, "tools": [{"name": "f"}]}),
        ("schema-not-object", {"messages": q, "tools": [{"name": "f", "input_schema": "x"}]}),
        ("no-name", {"messages": q, "tools": [{"input_schema": {}}]}),
        ("no-description", {"messages": q, "tools": [{"name": "f", "input_schema": {"type": "object"}}]}),
        ("strict", {"messages": q, "tools": [{**base, "strict": True}]}),
        ("strict-false", {"messages": q, "tools": [{**base, "strict": False}]}),
        ("defer", {"messages": q, "tools": [{**base, "defer_loading": True}]}),
        (
            "extra-keys",
            {"messages": q, "tools": [{**base, "cache_control": {"type": "ephemeral"}, "type": "custom"}]},
        ),
        (
            "server-tool",
            {"messages": q, "tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 5}]},
        ),
        (
            "choice-unknown-name",
            {"messages": q, "tools": [base], "tool_choice": {"type": "tool", "name": "nope"}},
        ),
        ("choice-tool-no-name", {"messages": q, "tools": [base], "tool_choice": {"type": "tool"}}),
        ("choice-bad", {"messages": q, "tools": [base], "tool_choice": {"type": "sometimes"}}),
        ("choice-string", {"messages": q, "tools": [base], "tool_choice": "auto"}),
        ("duplicate-names", {"messages": q, "tools": [base, {**base, "description": "again"}]}),
        (
            "removal",
            {
                "tools": [base, {**base, "name": "write_file"}],
                "messages": [
                    {
                        "role": "system",
                        "content": [
                            {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "write_file"}}
                        ],
                    },
                    *q,
                ],
            },
        ),
        (
            "addition-ref",
            {
                "tools": [{**base, "defer_loading": True}],
                "messages": [
                    {
                        "role": "system",
                        "content": [
                            {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "read_file"}}
                        ],
                    },
                    *q,
                ],
            },
        ),
        (
            "addition-def",
            {
                "tools": [base],
                "messages": [
                    {
                        "role": "system",
                        "content": [
                            {
                                "type": "tool_addition",
                                "tool": {
                                    "type": "tool_definition",
                                    "definition": {"name": "new_tool", "input_schema": {"properties": {}}},
                                },
                            }
                        ],
                    },
                    *q,
                ],
            },
        ),
        (
            "addition-def-no-tools",
            {
                "messages": [
                    {
                        "role": "system",
                        "content": [
                            {
                                "type": "tool_addition",
                                "tool": {
                                    "type": "tool_definition",
                                    "definition": {"name": "new_tool", "input_schema": {}},
                                },
                            }
                        ],
                    },
                    *q,
                ]
            },
        ),
        (
            "addition-unknown",
            {
                "tools": [base],
                "messages": [
                    {
                        "role": "system",
                        "content": [
                            {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "nope"}}
                        ],
                    },
                    *q,
                ],
            },
        ),
        (
            "removal-definition",
            {
                "tools": [base],
                "messages": [
                    {
                        "role": "system",
                        "content": [
                            {"type": "tool_removal", "tool": {"type": "tool_definition", "definition": base}}
                        ],
                    },
                    *q,
                ],
            },
        ),
        (
            "addition-no-tool",
            {"tools": [base], "messages": [{"role": "system", "content": [{"type": "tool_addition"}]}, *q]},
        ),
        (
            "add-remove-add",
            {
                "tools": [base, {**base, "name": "w"}],
                "messages": [
                    {
                        "role": "system",
                        "content": [
                            {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "w"}},
                            {"type": "text", "text": "S"},
                        ],
                    },
                    *q,
                    {"role": "assistant", "content": "ok"},
                    {
                        "role": "system",
                        "content": [
                            {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "w"}}
                        ],
                    },
                    {"role": "user", "content": "q2"},
                ],
            },
        ),
        (
            "show",
            {
                "messages": [
                    {"role": "system", "content": "S"},
                    *q,
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "thinking", "thinking": "t"},
                            {"type": "text", "text": "a"},
                            m.use("toolu_9"),
                        ],
                    },
                    {
                        "role": "user",
                        "content": [
                            m.result("toolu_9"),
                            {"type": "text", "text": "b", "cache_control": {"type": "ephemeral"}},
                        ],
                    },
                ],
                "tools": [
                    base,
                    {
                        **base,
                        "name": "g",
                        "input_schema": {"properties": {}},
                        "strict": True,
                        "defer_loading": False,
                    },
                ],
                "chat_template_kwargs": {"chat_template": SHOW_TEMPLATE, "x_var": "X"},
            },
        ),
        (
            "show-parts",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}},
                            {"type": "text", "text": "b"},
                        ],
                    },
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "text", "text": "c"},
                            {
                                "type": "tool_result",
                                "tool_use_id": "x",
                                "content": [{"type": "text", "text": "r"}],
                            },
                        ],
                    },
                ],
                "chat_template_kwargs": {"chat_template": SHOW_PARTS_TEMPLATE},
            },
        ),
        (
            "show-empty-tools",
            {"messages": q, "tools": [], "chat_template_kwargs": {"chat_template": SHOW_TEMPLATE}},
        ),
        (
            "show-disabled",
            {
                "messages": q,
                "thinking": {"type": "disabled"},
                "chat_template_kwargs": {"chat_template": SHOW_TEMPLATE},
            },
        ),
    ]
    for name, body in special:
        body.setdefault("max_tokens", 64)
        out.append(Case(f"mtools-{name}", body))
    return out


def _messages_flags(g: _Gen, m: _M) -> list[Case]:
    q = [{"role": "user", "content": g.text(1, 10)}]
    long = g.text(3000, 3200, 0.0)
    bodies: list[tuple[str, Body]] = [
        ("thinking-disabled", {"messages": q, "thinking": {"type": "disabled"}}),
        (
            "thinking-enabled",
            {"messages": q, "thinking": {"type": "enabled", "budget_tokens": 2048}, "max_tokens": 4096},
        ),
        (
            "thinking-enabled-small",
            {"messages": q, "thinking": {"type": "enabled", "budget_tokens": 100}, "max_tokens": 4096},
        ),
        (
            "thinking-budget-over",
            {"messages": q, "thinking": {"type": "enabled", "budget_tokens": 2048}, "max_tokens": 1024},
        ),
        ("thinking-adaptive", {"messages": q, "thinking": {"type": "adaptive"}}),
        (
            "thinking-adaptive-display",
            {"messages": q, "thinking": {"type": "adaptive", "display": "omitted"}},
        ),
        ("thinking-bad", {"messages": q, "thinking": {"type": "sometimes"}}),
        *[
            (f"effort-{e}", {"messages": q, "output_config": {"effort": e}})
            for e in ("low", "medium", "high", "xhigh", "max")
        ],
        ("effort-none", {"messages": q, "output_config": {"effort": "none"}}),
        (
            "effort-and-disabled",
            {"messages": q, "output_config": {"effort": "high"}, "thinking": {"type": "disabled"}},
        ),
        (
            "effort-kwargs",
            {
                "messages": q,
                "output_config": {"effort": "high"},
                "chat_template_kwargs": {"enable_thinking": False},
            },
        ),
        (
            "output-format",
            {
                "messages": q,
                "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
            },
        ),
        ("kwargs-thinking-off", {"messages": q, "chat_template_kwargs": {"enable_thinking": False}}),
        ("kwargs-var", {"messages": q, "chat_template_kwargs": {"x_var": "X"}}),
        ("kwargs-agp", {"messages": q, "chat_template_kwargs": {"add_generation_prompt": False}}),
        (
            "kwargs-continue",
            {
                "messages": [*q, {"role": "assistant", "content": "half"}],
                "chat_template_kwargs": {"continue_final_message": True},
            },
        ),
        ("stop", {"messages": q, "stop_sequences": ["\n\nHuman:", "END"]}),
        ("stop-empty", {"messages": q, "stop_sequences": []}),
        ("sampling", {"messages": q, "temperature": 0.3, "top_p": 0.9, "top_k": 4}),
        ("stream", {"messages": q, "stream": True}),
        ("metadata", {"messages": q, "metadata": {"user_id": "u"}}),
        ("max-tokens-missing", {"messages": q, "max_tokens": None}),
        ("max-tokens-zero", {"messages": q, "max_tokens": 0}),
        ("max-tokens-huge", {"messages": q, "max_tokens": 10**6}),
        ("too-long", {"messages": [{"role": "user", "content": long}]}),
        ("cache-salt", {"messages": q, "cache_salt": "salt"}),
        ("cache-salt-empty", {"messages": q, "cache_salt": ""}),
        ("kv-ids", {"messages": q, "kv_transfer_params": {"prompt_token_ids": [5, 6, 7]}}),
        ("kv-ids-bad", {"messages": q, "kv_transfer_params": {"prompt_token_ids": []}}),
        ("unknown-field", {"messages": q, "container": "c1", "service_tier": "auto"}),
    ]
    out = []
    for name, body in bodies:
        body.setdefault("max_tokens", 64)
        if body["max_tokens"] is None:
            del body["max_tokens"]
        out.append(Case(f"mflags-{name}", body))
    return out


def _messages_grow(g: _Gen, m: _M, conversations: int, turns: int) -> list[Case]:
    out = []
    for c in range(conversations):
        system: Any = _AGENT_INSTRUCTIONS + g.text(10, 40, 0.02)
        if c % 3 == 1:
            system = [
                {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2; cch={c:05x};"},
                {"type": "text", "text": system, "cache_control": {"type": "ephemeral"}},
            ]
        tools = [m.tool("read_file"), m.tool("run_tests")]
        msgs: list[dict[str, Any]] = []
        for t in range(turns):
            if t and c % 4 == 2:
                msgs.append({"role": "system", "content": f"<reminder>turn {t}</reminder>"})
            msgs.append({"role": "user", "content": g.text(2, 20) if t % 2 else m.text_blocks(1)})
            body: Body = {"system": system, "messages": _copy(msgs), "tools": tools, "max_tokens": 256}
            if c % 5 == 3:
                body["thinking"] = {"type": "disabled"}
            out.append(Case(f"mgrow-{c:02d}-{t:02d}", body))
            for k in range(g.r.randint(0, 2)):
                tid = f"toolu_{c}_{t}_{k}"
                blocks: list[dict[str, Any]] = []
                if c % 2 == 0:
                    blocks.append({"type": "thinking", "thinking": g.text(2, 10), "signature": "s"})
                if g.r.random() < 0.5:
                    blocks.append({"type": "text", "text": g.text(1, 8)})
                blocks.append(m.use(tid))
                msgs.append({"role": "assistant", "content": blocks})
                msgs.append({"role": "user", "content": [m.result(tid)]})
            msgs.append({"role": "assistant", "content": [{"type": "text", "text": g.text(3, 20)}]})
    return out


def build_agent_corpus(seed: int = 20261203) -> dict[str, list[Case]]:
    """The Responses and Messages corpus (deterministic for a seed)."""
    g = _Gen(seed)
    r, m = _R(g), _M(g)
    responses = [
        *_responses_strings(g, r),
        *_responses_items(g, r),
        *_responses_tools(g, r),
        *_responses_calls(g, r),
        *_responses_partial(g, r),
        *_responses_flags(g, r),
        *_responses_grow(g, r, 6, 8),
    ]
    messages = [
        *_messages_plain(g, m),
        *_messages_blocks(g, m),
        *_messages_tools(g, m),
        *_messages_flags(g, m),
        *_messages_grow(g, m, 6, 8),
    ]
    for cases in (responses, messages):
        ids = [c.id for c in cases]
        assert len(ids) == len(set(ids)), "duplicate case ids"
    return {"responses": responses, "messages": messages}
