"""A Responses API request as the chat request vLLM 0.33 renders for it (text-only, non-Harmony models).

vLLM does not template ``/v1/responses`` bodies itself: it turns ``instructions``, the conversation of a
``previous_response_id`` and the ``input`` items into chat messages and renders those with the chat
template, like a ``/v1/chat/completions`` request.  ``responses_chat_body`` builds that chat request, so
the one chat-encoding path (the tokenizer cache) computes the tokens::

    instructions ──▶ {"role": "system"}                                   (when non-empty)
    stored conversation of previous_response_id ──▶ its messages minus system ones, then one assistant
                                                    message per text part of its output messages
    input: a string ──▶ one user message
           items ──▶ function_call ─┐ merged into the previous assistant message when there is one:
                     reasoning    ──┤ its tool_calls / reasoning / content (if it has none yet)
                     assistant out ─┘
                     function_call_output, custom_tool_call_output ──▶ {"role": "tool"}
                     any other item with a role ──▶ itself (the keys its input type declares)
    tools: function tools (namespace members flattened to ``<namespace>__<name>``, custom tools as a
           one-string function); the others are never shown to the model
    template arguments: the request's chat_template_kwargs, then add_generation_prompt /
           continue_final_message (a last assistant or reasoning item "in_progress"/"incomplete" is
           continued), reasoning_effort and enable_thinking from ``reasoning.effort``

Facts read from vLLM 0.33 (``entrypoints/openai/responses/{utils,protocol}.py``,
``renderers/online_renderer.py``) and checked against its render server (``tools/agent_fixtures.py``).
``previous_input_messages`` is read only by the Harmony (gpt-oss) path: for other models vLLM ignores it,
and so does this.  Harmony models are rendered by a different engine: route them without tokens.

Whatever vLLM would refuse (an item type it does not take, encrypted reasoning, a malformed item) raises
``AgentInputError`` with vLLM's reason.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from typing import Any

from .errors import TokenizerCacheError

__all__ = [
    "AgentInputError",
    "RenderedResponses",
    "merge_template_kwargs",
    "response_output_messages",
    "responses_chat_body",
    "responses_tools",
]

Message = dict[str, Any]

# The keys pydantic keeps when it validates a plain message item against the input-message TypedDicts
# (EasyInputMessageParam / Message): every other key of the item is dropped before vLLM sees it.
_MESSAGE_KEYS = ("content", "role", "type", "phase", "status")
_CONTINUED = ("in_progress", "incomplete")


class AgentInputError(TokenizerCacheError, ValueError):
    """vLLM answers this request with a 400 (an input it does not take)."""

    def __init__(self, message: str, param: str = "input") -> None:
        super().__init__(message)
        self.param = param


class RenderedResponses:
    """What one Responses request renders to: its chat messages (what vLLM stores for a later
    ``previous_response_id``) and the whole chat request."""

    __slots__ = ("chat", "messages")

    def __init__(self, messages: list[Message], chat: dict[str, Any]) -> None:
        self.messages = messages
        self.chat = chat


def merge_template_kwargs(user: Mapping[str, Any] | None, extra: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's shallow merge of template arguments: ``extra`` wins where it is set (not None, not "auto")."""
    out = dict(user or {})
    out.update({k: v for k, v in extra.items() if v is not None and v != "auto"})
    return out


def _text(v: object) -> str | None:
    return v if isinstance(v, str) else None


def _function_call(item: Mapping[str, Any]) -> dict[str, Any]:
    """A ``function_call`` item as the chat tool call vLLM builds (400 unless it is a valid call)."""
    args, call_id, name = item.get("arguments"), item.get("call_id"), item.get("name")
    if not (isinstance(args, str) and isinstance(call_id, str) and isinstance(name, str)):
        raise AgentInputError("function_call items need string 'arguments', 'call_id' and 'name'")
    ns = item.get("namespace")
    if ns is not None and not isinstance(ns, str):
        raise AgentInputError("a function_call's 'namespace' must be a string")
    full = f"{ns}__{name}" if ns else name
    return {"id": call_id, "function": {"name": full, "arguments": args}, "type": "function"}


def _custom_call(item: Mapping[str, Any]) -> dict[str, Any]:
    call_id, name = item.get("call_id"), item.get("name")
    if not (isinstance(call_id, str) and isinstance(name, str)):
        raise AgentInputError("custom_tool_call items need string 'call_id' and 'name'")
    payload = json.dumps({"input": item.get("input") or ""}, ensure_ascii=False)
    return {"id": call_id, "function": {"name": name, "arguments": payload}, "type": "function"}


def _reasoning_text(item: Mapping[str, Any]) -> str:
    summary, content = item.get("summary"), item.get("content")
    if not isinstance(summary, list) or not all(
        isinstance(s, dict) and isinstance(s.get("text"), str) for s in summary
    ):
        raise AgentInputError("reasoning items need a 'summary' list of {type: summary_text, text}")
    if content is not None and not (
        isinstance(content, list)
        and all(isinstance(c, dict) and isinstance(c.get("text"), str) for c in content)
    ):
        raise AgentInputError("a reasoning item's 'content' must be a list of {type: reasoning_text, text}")
    if item.get("encrypted_content"):
        raise AgentInputError("Encrypted content is not supported.")
    if content:
        return str(content[0]["text"])
    return str(summary[0]["text"]) if summary else ""


def _output_message(item: Mapping[str, Any]) -> str | None:
    """The text vLLM keeps of an assistant message item with list content (the first part's), or None
    when the item is not a valid output message (then it is validated as a plain message)."""
    content = item.get("content")
    if not isinstance(content, list) or not content:
        return None
    for part in content:
        if not isinstance(part, dict):
            return None
        kind = part.get("type")
        if kind == "output_text" and isinstance(part.get("text"), str):
            continue
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            continue
        return None
    first = content[0]
    if first.get("type") != "output_text":
        raise AgentInputError("an assistant message whose first part is a refusal cannot be rendered")
    return str(first["text"])


def _attach(prev: Message | None, key: str, value: Any) -> bool:
    """Put ``value`` under ``key`` of the previous assistant message if it has none yet (tool calls are
    appended); False when a new assistant message is needed."""
    if prev is None or prev.get("role") != "assistant":
        return False
    if key == "tool_calls":
        calls = prev.get("tool_calls")
        if calls is None:
            prev["tool_calls"] = [value]
            return True
        if isinstance(calls, list):
            calls.append(value)
            return True
        return False
    if prev.get(key) is None:
        prev[key] = value
        return True
    return False


def _item_message(item: Any, prev: Message | None) -> Message | None:
    """One input item as a new chat message, or None when it was merged into ``prev``."""
    if not isinstance(item, dict):
        raise AgentInputError("every input item must be an object")
    kind = item.get("type")
    if kind in ("function_call", "custom_tool_call"):
        call = _function_call(item) if kind == "function_call" else _custom_call(item)
        if _attach(prev, "tool_calls", call):
            return None
        return {"role": "assistant", "tool_calls": [call]}
    if kind == "reasoning":
        text = _reasoning_text(item)
        return None if _attach(prev, "reasoning", text) else {"role": "assistant", "reasoning": text}
    if kind in ("function_call_output", "custom_tool_call_output"):
        return {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
    role = item.get("role")
    if role == "assistant":
        out = _output_message(item) if kind == "message" else None
        content = item.get("content")
        if out is None:
            if isinstance(content, str):
                out = content
            elif isinstance(content, list) and content and isinstance(content[0], dict):
                out = _text(content[0].get("text"))
        if out is not None:
            return None if _attach(prev, "content", out) else {"role": "assistant", "content": out}
    if isinstance(role, str) and kind in (None, "message"):
        return {k: copy.deepcopy(item[k]) for k in _MESSAGE_KEYS if k in item}
    raise AgentInputError(f"Unsupported input item type: {kind}")


def continues_final(items: object) -> bool:
    """vLLM continues the last input item instead of starting a new answer when it is an assistant
    message or a reasoning item whose status is in_progress or incomplete."""
    if not isinstance(items, list) or not items or not isinstance(items[-1], dict):
        return False
    last = items[-1]
    kind = last.get("type", "message")
    if kind not in ("message", "reasoning"):
        return False
    # A message with string content is validated as an easy input message, which has no status field:
    # its status is dropped before vLLM looks.
    if kind == "message" and not isinstance(last.get("content"), list):
        return False
    return last.get("status") in _CONTINUED


def responses_tools(tools: object) -> list[dict[str, Any]] | None:
    """The request's tools as chat-completions tools (what the chat template is shown)."""
    if not isinstance(tools, list) or not tools:
        return None
    out: list[dict[str, Any]] = []
    for tool in tools:
        if not isinstance(tool, dict):
            raise AgentInputError("every tool must be an object", "tools")
        kind = tool.get("type")
        if kind == "function":
            out.append(_function_tool(tool, tool.get("name")))
        elif kind == "namespace":
            subs = tool.get("tools")
            if not isinstance(subs, list):
                raise AgentInputError("a namespace tool needs a 'tools' list", "tools")
            for sub in subs:
                if isinstance(sub, dict) and sub.get("type") == "function":
                    out.append(_function_tool(sub, f"{tool.get('name')}__{sub.get('name')}"))
        elif kind == "custom":
            params = {
                "type": "object",
                "properties": {
                    "input": {"type": "string", "description": "The freeform text payload for this tool."}
                },
                "required": ["input"],
                "additionalProperties": False,
            }
            fn = {"name": tool.get("name"), "description": tool.get("description"), "parameters": params}
            out.append({"type": "function", "function": fn})
    return out


def _function_tool(tool: Mapping[str, Any], name: object) -> dict[str, Any]:
    if not isinstance(name, str):
        raise AgentInputError("a function tool needs a string 'name'", "tools")
    fn: dict[str, Any] = {
        "name": name,
        "description": tool.get("description"),
        "parameters": tool.get("parameters"),
    }
    for key in ("strict", "defer_loading"):
        if tool.get(key) is not None:
            fn[key] = tool[key]
    return {"type": "function", "function": fn}


_TEXT_PARTS = frozenset({"input_text", "output_text"})
_RENDERED_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning")


def _as_chat_message(m: Message) -> Message:
    """A converted message in the chat API's own vocabulary, rendering the same: vLLM hands the Responses
    path's messages straight to its chat parser, which reads ``input_text`` / ``output_text`` parts as text
    parts and ignores item keys (``type``, ``status``, ``phase``); a chat request must spell them so."""
    out = {k: m[k] for k in _RENDERED_KEYS if k in m}
    content = out.get("content")
    if isinstance(content, list):
        out["content"] = [
            {"type": "text", "text": p.get("text")}
            if isinstance(p, dict) and p.get("type") in _TEXT_PARTS
            else p
            for p in content
        ]
    return out


def response_output_messages(output: Sequence[Mapping[str, Any]]) -> list[Message]:
    """A stored response's output as the history of the next turn: one assistant message per part of
    each output message (reasoning and tool-call items are not carried over)."""
    out: list[Message] = []
    for item in output:
        if item.get("type") != "message":
            continue
        for part in item.get("content") or []:
            if isinstance(part, dict):
                out.append({"role": "assistant", "content": part.get("text")})
    return out


def responses_chat_body(
    body: Mapping[str, Any],
    *,
    previous_messages: Sequence[Mapping[str, Any]] | None = None,
    previous_output: Sequence[Mapping[str, Any]] | None = None,
    reasoning_effort_map: Mapping[str, str] | None = None,
) -> RenderedResponses:
    """The chat request vLLM renders for the Responses ``body``.  ``previous_messages`` and
    ``previous_output``: what the instance stored for ``previous_response_id`` (its messages, its output
    items).  Raises ``AgentInputError``."""
    if body.get("prompt") is not None:
        raise AgentInputError("prompt template is not supported", "prompt")
    if "input" not in body:
        raise AgentInputError("'input' is required")
    items = body["input"]
    messages: list[Message] = []
    instructions = body.get("instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if previous_messages is not None:
        messages.extend(copy.deepcopy(dict(m)) for m in previous_messages if m.get("role") != "system")
    if previous_output is not None:
        messages.extend(response_output_messages(previous_output))
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list):
        new: list[Message] = []
        for item in items:
            msg = _item_message(item, new[-1] if new else None)
            if msg is not None:
                new.append(msg)
        messages.extend(new)
    else:
        raise AgentInputError("'input' must be a string or a list of items")
    cont = continues_final(items)
    reasoning = body.get("reasoning")
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else None
    if isinstance(effort, str) and reasoning_effort_map:
        effort = reasoning_effort_map.get(effort, effort)
    user_kwargs = body.get("chat_template_kwargs")
    if user_kwargs is not None and not isinstance(user_kwargs, dict):
        raise AgentInputError("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    extra: dict[str, Any] = {
        "add_generation_prompt": not cont,
        "continue_final_message": cont,
        "reasoning_effort": effort,
    }
    if effort is not None and "enable_thinking" not in (user_kwargs or {}):
        extra["enable_thinking"] = effort != "none"
    kwargs = merge_template_kwargs(user_kwargs, extra)
    chat: dict[str, Any] = {
        "messages": [_as_chat_message(m) for m in messages],
        "add_generation_prompt": kwargs.get("add_generation_prompt", not cont),
        "continue_final_message": kwargs.get("continue_final_message", cont),
        "chat_template_kwargs": kwargs,
    }
    tools = responses_tools(body.get("tools"))
    if tools:  # none of them a function (built-in tools only): the template sees an empty list, as no tools
        chat["tools"] = tools
    return RenderedResponses(messages, chat)
