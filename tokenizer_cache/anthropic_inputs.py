"""An Anthropic Messages request (``/v1/messages``, ``/v1/messages/count_tokens``) as the chat request vLLM
0.33 renders for it.

vLLM converts the body to a chat-completions request and renders that (``entrypoints/anthropic/
serving.py``; checked against its render server's ``/v1/messages/render``): ``system`` and inline system
messages become system messages (one first message when the template demands system-first ordering);
text blocks become text parts, thinking ``reasoning``, tool_use ``tool_calls``, a user's tool_result a
tool message; tools become function tools (with ``tool_addition`` / ``tool_removal`` applied) and
``tool_choice`` "auto" when tools come without one; ``thinking`` and ``output_config.effort`` set
``reasoning_effort``.

``AgentInputError`` for what vLLM refuses with a 400 (unknown block or role, a tool change outside a
system message, a change naming an undeclared tool).  Every rule, with its source: docs/parity.md,
section 9.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox

from .agent_inputs import AgentInputError
from .request_schema import Invalid, lax_bool, lax_int

__all__ = [
    "EFFORTS",
    "MessagesChat",
    "disabled_thinking_effort",
    "messages_request",
    "requires_system_first",
]

Message = dict[str, Any]
BILLING = "x-anthropic-billing-header"
BLOCKS = frozenset(
    {"text", "image", "tool_use", "tool_result", "tool_reference", "thinking", "redacted_thinking"}
    | {"tool_addition", "tool_removal"}
)
EFFORTS = ("low", "medium", "high", "xhigh", "max")
"""Anthropic's effort levels, in the order vLLM probes them."""


def requires_system_first(template: str | None) -> bool:
    """Whether a template refuses system messages after the first message (vLLM's probe: render
    system, user, system, user in a bare sandbox; any template error means yes, as does no template)."""
    if not template:
        return True
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    probe = [{"role": r, "content": "t"} for r in ("system", "user", "system", "user")]
    try:
        env.from_string(template).render(messages=probe, add_generation_prompt=False)
    except jinja2.TemplateError:
        return True
    return False


def disabled_thinking_effort(render: Callable[[dict[str, Any]], object]) -> str:
    """The reasoning_effort vLLM sends for ``thinking: {type: disabled}``: "none", unless the template
    fails on it or renders it like some thinking effort (it ignores "none"), then "low".  ``render``
    renders ``[{"role": "user", "content": "Hi"}]`` with these template arguments (raising on error)."""

    def prompt(effort: str) -> object:
        return render({"reasoning_effort": effort, "enable_thinking": effort != "none"})

    try:
        none = prompt("none")
    except Exception:
        return "low"
    for effort in EFFORTS:
        try:
            if prompt(effort) == none:
                return "low"
        except Exception:
            continue
    return "none"


_BLOCK_STR = ("text", "id", "tool_use_id", "name", "tool_name", "thinking", "signature", "data")


def _block(b: object, where: str) -> dict[str, Any]:
    """A content block as vLLM's ``AnthropicContentBlock`` validates it (400 when it does not)."""
    if not isinstance(b, dict) or b.get("type") not in BLOCKS:
        kind = b.get("type") if isinstance(b, dict) else b
        raise AgentInputError(f"{where}: unknown content block type {kind!r}", "messages")
    for key in _BLOCK_STR:
        if b.get(key) is not None and not isinstance(b[key], str):
            raise AgentInputError(f"{where}: {key!r} must be a string", "messages")
    for key in ("source", "input"):
        if b.get(key) is not None and not isinstance(b[key], dict):
            raise AgentInputError(f"{where}: {key!r} must be an object", "messages")
    content = b.get("content")
    if (
        content is not None
        and not isinstance(content, str)
        and not (isinstance(content, list) and all(isinstance(c, dict) for c in content))
    ):
        raise AgentInputError(f"{where}: a block's content must be a string or a list of objects", "messages")
    if b.get("is_error") is not None:
        _lax_bool(b["is_error"], where)
    if b["type"] in ("tool_addition", "tool_removal"):
        change = b.get("tool")
        if not isinstance(change, dict) or change.get("type") not in ("tool_reference", "tool_definition"):
            raise AgentInputError(f"tool is required for {b['type']} blocks", "messages")
        if b["type"] == "tool_removal" and change["type"] != "tool_reference":
            raise AgentInputError("tool_removal only accepts a tool_reference", "messages")
        if change["type"] == "tool_reference" and not isinstance(change.get("name"), str):
            raise AgentInputError("a tool_reference needs a string 'name'", "messages")
        if change["type"] == "tool_definition":
            _tool(change.get("definition"), where)
    elif b.get("tool") is not None:
        raise AgentInputError(f"{where}: 'tool' is only for tool changes", "messages")
    return b


def _lax_bool(v: object, where: str) -> bool:
    try:
        return lax_bool(v)
    except Invalid:
        raise AgentInputError(f"{where}: a boolean field is not a boolean", "messages") from None


def _blocks(content: object, where: str) -> list[dict[str, Any]]:
    if not isinstance(content, list):
        raise AgentInputError(f"{where} must be a string or a list of content blocks", "messages")
    return [_block(b, f"{where}[{i}]") for i, b in enumerate(content)]


def _system_text(content: object) -> str | None:
    if isinstance(content, str):
        return None if content.startswith(BILLING) else content
    parts = [
        b["text"]
        for b in _blocks(content, "a system message")
        if b.get("type") == "text" and isinstance(b.get("text"), str) and b["text"]
        if not b["text"].startswith(BILLING)
    ]
    return "".join(parts) if parts else None


def _image_url(source: object) -> str:
    s = source if isinstance(source, dict) else {}
    if s.get("type") == "url":
        return str(s.get("url", ""))
    return f"data:{s.get('media_type', 'image/jpeg')};base64,{s.get('data', '')}"


def _user_tool_result(block: Mapping[str, Any], out: list[Message]) -> None:
    content = block.get("content")
    text, images, refs = "", [], []
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for item in content:
            kind = item.get("type")
            if kind == "text":
                texts.append(item.get("text", ""))
            elif kind == "image":
                url = _image_url(item.get("source", {}))
                if url:
                    images.append(url)
            elif kind == "tool_reference":
                name = item.get("tool_name") or item.get("name")
                if name:
                    refs.append({"type": "tool_reference", "name": name})
        text = "\n".join(texts)
    call_id = block.get("tool_use_id") or ""
    out.append({"role": "tool", "tool_call_id": call_id, "content": text or ""})
    if images:
        out.append(
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}} for u in images]}
        )
    if refs:
        out.append({"role": "tool", "tool_call_id": call_id, "content": refs})


def _message(role: str, content: object, out: list[Message]) -> None:
    msg: Message = {"role": role}
    if isinstance(content, str):
        msg["content"] = content
    else:
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        reasoning: list[str] = []
        for b in _blocks(content, "a message's content"):
            kind = b.get("type")
            if kind == "text" and b.get("text"):
                parts.append({"type": "text", "text": b["text"]})
            elif kind == "image" and b.get("source"):
                parts.append({"type": "image_url", "image_url": {"url": _image_url(b["source"])}})
            elif kind == "thinking" and b.get("thinking") is not None:
                reasoning.append(str(b["thinking"]))
            elif kind == "tool_use":
                # json.dumps as vLLM calls it (ASCII escapes); the chat parser reads the object back
                args = json.dumps(b.get("input") or {})
                fn = {"name": b.get("name") or "", "arguments": args}
                calls.append(
                    {"id": b.get("id") or f"call_{int(time.time())}", "type": "function", "function": fn}
                )
            elif kind == "tool_result":
                if role == "user":
                    _user_tool_result(b, out)
                else:
                    result = str(b.get("content")) if b.get("content") else ""
                    parts.append({"type": "text", "text": f"Tool result: {result}"})
        if reasoning:
            msg["reasoning"] = "".join(reasoning)
        if calls:
            msg["tool_calls"] = calls
        if parts:
            msg["content"] = parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts
    if not (role == "user" and "content" not in msg):
        out.append(msg)


def _tool(t: object, where: str) -> dict[str, Any]:
    """A tool as vLLM's ``AnthropicTool`` validates it: a schema without ``type`` gets ``"object"``."""
    if (
        not isinstance(t, dict)
        or not isinstance(t.get("name"), str)
        or not isinstance(t.get("input_schema"), dict)
    ):
        raise AgentInputError(
            f"{where}: every tool needs a string 'name' and an 'input_schema' object", "tools"
        )
    if t.get("description") is not None and not isinstance(t["description"], str):
        raise AgentInputError(f"{where}: a tool's description must be a string", "tools")
    schema = t["input_schema"]
    if "type" not in schema:
        schema = {**schema, "type": "object"}
    out = {"name": t["name"], "description": t.get("description"), "input_schema": schema}
    for key in ("strict", "defer_loading"):
        out[key] = None if t.get(key) is None else _lax_bool(t[key], where)
    return out


def _tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The tools in effect at the end of the conversation (tool changes in system messages applied)."""
    raw = body.get("tools")
    if raw is not None and not isinstance(raw, list):
        raise AgentInputError("'tools' must be a list of tool definitions", "tools")
    tools = None if raw is None else [_tool(t, f"tools[{i}]") for i, t in enumerate(raw)]
    changes = [
        b
        for m in body["messages"]
        if isinstance(m["content"], list)
        for b in m["content"]
        if b.get("type") in ("tool_addition", "tool_removal")
    ]
    if not changes:
        return tools
    by_name: dict[str, dict[str, Any]] = {t["name"]: t for t in tools or []}
    removed: set[str] = set()
    for b in changes:
        change = b["tool"]
        if change["type"] == "tool_definition":
            name = change["definition"]["name"]
            by_name[name] = _tool(change["definition"], "a tool_addition")
        else:
            name = change["name"]
            if name not in by_name:
                raise AgentInputError(f"{b['type']} references tool {name!r}, which is not declared in tools")
            if b["type"] == "tool_addition":
                by_name[name] = {**by_name[name], "defer_loading": None}
        if b["type"] == "tool_removal":
            removed.add(name)
        else:
            removed.discard(name)
    return [t for n, t in by_name.items() if n not in removed]


_EFFORT_VALUES = (None, *EFFORTS)
# Chat request fields vLLM's conversion copies from the Messages request (``_build_base_request``).
_COPIED = ("stop_sequences", "temperature", "top_p", "top_k", "cache_salt", "kv_transfer_params")


class MessagesChat:
    """The chat request vLLM renders for a Messages body: ``body``, validated as a chat request is, then
    the fields vLLM sets on the validated request (``tools``, ``tool_choice``, ``reasoning_effort``: not
    validated again, so ``tools: []`` and a named tool that is not declared pass)."""

    __slots__ = ("assigned", "body")

    def __init__(self, body: dict[str, Any], assigned: dict[str, Any]) -> None:
        self.body = body
        self.assigned = assigned


def _thinking(body: Mapping[str, Any], max_tokens: int | None) -> str | None:
    thinking = body.get("thinking")
    if thinking is None:
        return None
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise AgentInputError("thinking.type must be enabled, disabled or adaptive", "thinking")
    assert isinstance(thinking, dict)
    if thinking.get("display") not in (None, "summarized", "omitted", "updates"):
        raise AgentInputError("thinking.display must be summarized, omitted or updates", "thinking")
    if kind == "enabled":
        try:
            budget = lax_int(thinking.get("budget_tokens"))
        except Invalid:
            raise AgentInputError("thinking.budget_tokens must be an integer", "thinking") from None
        if budget < 1024:
            raise AgentInputError("thinking.budget_tokens must be >= 1024", "thinking")
        kv = body.get("kv_transfer_params")
        if (
            max_tokens is not None
            and budget >= max_tokens
            and not (isinstance(kv, dict) and kv.get("do_remote_decode"))
        ):
            raise AgentInputError("thinking.budget_tokens must be less than max_tokens", "thinking")
    return str(kind)


def _choice(body: Mapping[str, Any]) -> dict[str, Any] | None:
    choice = body.get("tool_choice")
    if choice is None:
        return None
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise AgentInputError("tool_choice.type must be auto, any, tool or none", "tool_choice")
    if choice.get("name") is not None and not isinstance(choice["name"], str):
        raise AgentInputError("tool_choice.name must be a string", "tool_choice")
    if choice["type"] == "tool" and not choice.get("name"):
        raise AgentInputError("tool_choice.name is required when type is 'tool'", "tool_choice")
    return choice


def messages_request(
    body: Mapping[str, Any],
    *,
    merge_inline_system: bool = False,
    disabled_effort: str = "none",
    count_tokens: bool = False,
) -> MessagesChat:
    """The chat request vLLM renders for an Anthropic Messages ``body`` (``to_chat_completion_request``);
    ``merge_inline_system`` and ``disabled_effort`` are the model's (``requires_system_first``,
    ``disabled_thinking_effort``); ``count_tokens``: a ``/v1/messages/count_tokens`` body (no
    ``max_tokens``; only the messages, tools and template arguments are carried over).  Raises
    ``AgentInputError`` for what vLLM's Messages model refuses."""
    if not isinstance(body, Mapping):
        raise AgentInputError("the request body must be a JSON object", "body")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
        raise AgentInputError("'messages' must be a list of messages", "messages")
    for m in msgs:
        if m.get("role") not in ("user", "assistant", "system"):
            raise AgentInputError(f"unknown message role {m.get('role')!r}", "messages")
        content = m.get("content")
        if not isinstance(content, str):
            blocks = _blocks(content, "a message's content")
            if m["role"] != "system" and any(b["type"] in ("tool_addition", "tool_removal") for b in blocks):
                raise AgentInputError(
                    'tool_addition and tool_removal blocks are only allowed in messages with role "system"',
                    "messages",
                )
    max_tokens = 0
    if not count_tokens:
        try:
            max_tokens = lax_int(body.get("max_tokens"))
        except Invalid:
            raise AgentInputError("max_tokens is required (an integer)", "max_tokens") from None
        if max_tokens <= 0:
            raise AgentInputError("max_tokens must be positive", "max_tokens")
    top = body.get("system")
    if (top is not None and not isinstance(top, str)) and any(
        b["type"] in ("tool_addition", "tool_removal") for b in _blocks(top, "system")
    ):
        raise AgentInputError("tool changes are only allowed in messages with role system", "system")
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise AgentInputError("'output_config' must be an object", "output_config")
    effort = (config or {}).get("effort")
    if effort not in _EFFORT_VALUES:
        raise AgentInputError(f"output_config.effort must be one of {list(EFFORTS)}", "output_config")
    thinking = _thinking(body, max_tokens if not count_tokens else None)
    choice = _choice(body)
    tools = _tools(body)
    user_kwargs = body.get("chat_template_kwargs")
    if user_kwargs is not None and not isinstance(user_kwargs, dict):
        raise AgentInputError("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    cache_salt = body.get("cache_salt")
    if cache_salt is not None and (not isinstance(cache_salt, str) or not 1 <= len(cache_salt) <= 1024):
        raise AgentInputError("cache_salt must be a string of 1 to 1024 characters", "cache_salt")
    stops = body.get("stop_sequences")
    if stops is not None and (not isinstance(stops, list) or not all(isinstance(x, str) for x in stops)):
        raise AgentInputError("stop_sequences must be a list of strings", "stop_sequences")

    out: list[Message] = []
    system: list[str] = []
    if isinstance(top, str):
        if top:
            system.append(top)
    elif top:
        system.extend(
            b["text"]
            for b in top
            if b.get("type") == "text" and b.get("text") and not b["text"].startswith(BILLING)
        )
    if merge_inline_system:
        system.extend(t for m in msgs if m["role"] == "system" and (t := _system_text(m["content"])))
    if system:
        out.append({"role": "system", "content": "".join(system)})
    for m in msgs:
        if m["role"] == "system":
            if not merge_inline_system and (t := _system_text(m["content"])):
                out.append({"role": "system", "content": t})
            continue
        _message(m["role"], m["content"], out)

    chat: dict[str, Any] = {"messages": out}
    if not count_tokens:
        chat["max_tokens"] = chat["max_completion_tokens"] = max_tokens
        for key in _COPIED:
            if body.get(key) is not None:
                chat["stop" if key == "stop_sequences" else key] = body[key]
    if user_kwargs is not None:
        chat["chat_template_kwargs"] = user_kwargs
    assigned: dict[str, Any] = {}
    if effort is not None:
        assigned["reasoning_effort"] = effort
    if thinking == "disabled":
        assigned["reasoning_effort"] = disabled_effort
    if choice is not None:
        kind = choice["type"]
        assigned["tool_choice"] = (
            {"type": "function", "function": {"name": choice["name"]}}
            if kind == "tool"
            else {"auto": "auto", "any": "required", "none": "none"}[kind]
        )
    if tools is not None:
        assigned["tools"] = [_chat_tool(t) for t in tools]
        assigned.setdefault("tool_choice", "auto")
    return MessagesChat(chat, assigned)


def _chat_tool(t: Mapping[str, Any]) -> dict[str, Any]:
    """An Anthropic tool as vLLM dumps its chat tool: ``strict`` / ``defer_loading`` only when set."""
    fn: dict[str, Any] = {"name": t["name"], "description": t["description"], "parameters": t["input_schema"]}
    for key in ("strict", "defer_loading"):
        if t[key] is not None:
            fn[key] = t[key]
    return {"type": "function", "function": fn}
