"""An Anthropic Messages request (``/v1/messages``, ``/v1/messages/count_tokens``) as the chat request vLLM
0.33 renders for it.

vLLM converts the body to a chat-completions request and renders that (``entrypoints/anthropic/
serving.py``, read for every step below; checked against its render server's ``/v1/messages/render``)::

    system (a string, or text blocks joined with "", billing-header blocks dropped) ──▶ first message
    inline system messages ──▶ system messages in place, or appended to the first one when the template
                               demands system-first ordering (``requires_system_first``)
    user / assistant blocks: text ──▶ text parts (one part: a plain string); thinking ──▶ "reasoning";
                             tool_use ──▶ tool_calls (arguments: the input as JSON);
                             tool_result (user) ──▶ a tool message each, before the message's own text;
                             tool_result (assistant) ──▶ a "Tool result: ..." text part
    tools ──▶ function tools (tool_addition / tool_removal blocks in system messages applied);
              tool_choice auto when tools come without one
    thinking {type: disabled} ──▶ reasoning_effort: "none", or "low" for templates that ignore "none"
    output_config.effort ──▶ reasoning_effort (thinking disabled wins)

``AgentInputError`` for what vLLM refuses with a 400 (unknown block or role, a tool change outside a
system message, a change naming an undeclared tool).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox

from .agent_inputs import AgentInputError, merge_template_kwargs

__all__ = [
    "EFFORTS",
    "disabled_thinking_effort",
    "messages_chat_body",
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


def _blocks(content: object, where: str) -> list[dict[str, Any]]:
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise AgentInputError(f"{where} must be a string or a list of content blocks", "messages")
    for b in content:
        if b.get("type") not in BLOCKS:
            raise AgentInputError(f"unknown content block type {b.get('type')!r}", "messages")
    return content


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
            if not isinstance(item, dict):
                continue
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
            elif kind in ("tool_addition", "tool_removal"):
                raise AgentInputError(
                    f'{kind} blocks are only allowed in messages with role "system"', "messages"
                )
        if reasoning:
            msg["reasoning"] = "".join(reasoning)
        if calls:
            msg["tool_calls"] = calls
        if parts:
            msg["content"] = parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts
    if not (role == "user" and "content" not in msg):
        out.append(msg)


def _tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The tools in effect at the end of the conversation (tool changes in system messages applied)."""
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise AgentInputError("'tools' must be a list of tool definitions", "tools")
    changes = [
        b
        for m in body.get("messages") or []
        if isinstance(m, dict) and isinstance(m.get("content"), list)
        for b in m["content"]
        if isinstance(b, dict) and b.get("type") in ("tool_addition", "tool_removal")
    ]
    if not changes:
        return tools
    by_name: dict[str, dict[str, Any]] = {str(t.get("name")): t for t in tools or []}
    removed: set[str] = set()
    for b in changes:
        change = b.get("tool")
        if not isinstance(change, dict):
            raise AgentInputError(f"tool is required for {b.get('type')} blocks", "messages")
        if isinstance(change.get("definition"), dict):
            name = str(change["definition"].get("name"))
            by_name[name] = change["definition"]
        else:
            name = str(change.get("name"))
            if name not in by_name:
                raise AgentInputError(f"{b['type']} references tool {name!r}, which is not declared in tools")
            if b["type"] == "tool_addition":
                by_name[name] = {**by_name[name], "defer_loading": None}
        if b["type"] == "tool_removal":
            removed.add(name)
        else:
            removed.discard(name)
    return [t for n, t in by_name.items() if n not in removed]


def messages_chat_body(
    body: Mapping[str, Any], *, merge_inline_system: bool = False, disabled_effort: str = "none"
) -> dict[str, Any]:
    """The chat request vLLM renders for an Anthropic Messages ``body``; ``merge_inline_system`` and
    ``disabled_effort`` are the model's (``requires_system_first``, ``disabled_thinking_effort``).
    Raises ``AgentInputError``."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
        raise AgentInputError("'messages' must be a list of messages", "messages")
    for m in msgs:
        if m.get("role") not in ("user", "assistant", "system"):
            raise AgentInputError(f"unknown message role {m.get('role')!r}", "messages")
        if not isinstance(m.get("content"), str):
            _blocks(m.get("content"), "a message's content")
    out: list[Message] = []
    system: list[str] = []
    top = body.get("system")
    if isinstance(top, str):
        if top:
            system.append(top)
    elif top is not None:
        t = _system_text(top)
        if t:
            system.append(t)
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
    effort: str | None = None
    config = body.get("output_config")
    if isinstance(config, dict) and config.get("effort") is not None:
        effort = str(config["effort"])
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "disabled":
        effort = disabled_effort
    user_kwargs = body.get("chat_template_kwargs")
    if user_kwargs is not None and not isinstance(user_kwargs, dict):
        raise AgentInputError("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    extra: dict[str, Any] = {"add_generation_prompt": True, "continue_final_message": False}
    extra["reasoning_effort"] = effort
    if effort is not None and "enable_thinking" not in (user_kwargs or {}):
        extra["enable_thinking"] = effort != "none"
    chat: dict[str, Any] = {
        "messages": out,
        "add_generation_prompt": True,
        "continue_final_message": False,
        "chat_template_kwargs": merge_template_kwargs(user_kwargs, extra),
    }
    tools = _tools(body)
    if tools is not None:
        chat["tools"] = [
            {"type": "function", "function": _anthropic_tool(t)} for t in tools if isinstance(t, dict)
        ]
        choice = body.get("tool_choice")
        chat["tool_choice"] = _tool_choice(choice) if isinstance(choice, dict) else "auto"
    return chat


def _anthropic_tool(t: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(t.get("name"), str) or not isinstance(t.get("input_schema"), dict):
        raise AgentInputError("every tool needs a 'name' and an 'input_schema' object", "tools")
    fn: dict[str, Any] = {
        "name": t["name"],
        "description": t.get("description"),
        "parameters": t["input_schema"],
    }
    for key in ("strict", "defer_loading"):
        if t.get(key) is not None:
            fn[key] = t[key]
    return fn


def _tool_choice(choice: Mapping[str, Any]) -> object:
    kind = choice.get("type")
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return {"auto": "auto", "any": "required", "none": "none"}.get(str(kind), "auto")
