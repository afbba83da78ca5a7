"""A Responses API request's input items and tools as the chat messages and tools vLLM 0.33 renders
(text-only, non-Harmony models).

vLLM validates the body against its request model (pydantic over OpenAI's item types), turns
``instructions``, a stored conversation and the ``input`` items into chat messages
(``responses/utils.py`` ``construct_input_messages``) and renders them with the chat template, without
the chat request model's validation (``responses_request.plan_responses`` does the rest).  Here:
``instructions`` become a system message, a string input one user message; function and custom tool
calls, reasoning and assistant output messages merge into the previous assistant message; tool outputs
become tool messages; message items stay themselves; tools are function tools (namespace members as
``<namespace>__<name>``, custom tools as one-string functions; built-in tools never shown).
``status`` of the last item decides whether it is continued (``continues_final``).

Whatever vLLM refuses (an item type it does not render, encrypted reasoning, an item no type accepts)
raises ``AgentInputError`` with vLLM's reason.  Every rule, with its source: docs/parity.md, section 8.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from .errors import TokenizerCacheError

__all__ = [
    "AgentInputError",
    "continues_final",
    "merge_template_kwargs",
    "response_output_messages",
    "responses_messages",
    "responses_tools",
]

Message = dict[str, Any]

_CONTINUED = ("in_progress", "incomplete")
_STATUSES = ("in_progress", "completed", "incomplete")
_INPUT_ROLES = ("user", "system", "developer")
_EASY_ROLES = ("user", "assistant", "system", "developer")
_PHASES = ("commentary", "final_answer")
# Items vLLM's request model accepts but its conversion does not render (a 400 either way).
_UNRENDERED = "Unsupported input item type: {}"


class AgentInputError(TokenizerCacheError, ValueError):
    """vLLM answers this request with a 400 (an input it does not take)."""

    def __init__(self, message: str, param: str = "input") -> None:
        super().__init__(message)
        self.param = param


def merge_template_kwargs(user: Mapping[str, Any] | None, extra: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's shallow merge of template arguments: ``extra`` wins where it is set (not None, not "auto")."""
    out = dict(user or {})
    out.update({k: v for k, v in extra.items() if v is not None and not (isinstance(v, str) and v == "auto")})
    return out


def _is_str(v: object) -> bool:
    return isinstance(v, str)


def _opt_str(v: object) -> bool:
    return v is None or isinstance(v, str)


# -- OpenAI's item types, as far as they decide what vLLM renders ------------------------------------------


def _input_part(part: object) -> dict[str, Any] | None:
    """An input content part (input_text / input_image / input_file) as OpenAI's types accept it (their
    undeclared keys kept; an image without ``detail`` gets "auto"), or None when it is none of them."""
    if not isinstance(part, dict):
        return None
    kind = part.get("type")
    if kind == "input_text":
        return part if _is_str(part.get("text")) else None
    if kind == "input_image":
        if "detail" not in part:
            part = {**part, "detail": "auto"}
        if part["detail"] not in ("low", "high", "auto", "original") or not all(
            _opt_str(part.get(k)) for k in ("file_id", "image_url")
        ):
            return None
        return part
    if kind == "input_file":
        keys = ("file_data", "file_id", "file_url", "filename", "detail")
        return part if all(_opt_str(part.get(k)) for k in keys) else None
    return None


def _input_parts(content: object) -> list[dict[str, Any]] | None:
    if not isinstance(content, list):
        return None
    parts = [_input_part(p) for p in content]
    return None if any(p is None for p in parts) else [p for p in parts if p is not None]


def _message_item(item: dict[str, Any]) -> dict[str, Any] | None:
    """A message item as OpenAI's input message types accept it (every key kept), or None when none
    does."""
    if item.get("type", "message") != "message" or item.get("role") not in _EASY_ROLES:
        return None
    if item.get("phase") is not None and item["phase"] not in _PHASES:
        return None
    if item.get("status") is not None and item["status"] not in _STATUSES:
        return None
    content = item.get("content")
    if isinstance(content, str):
        return dict(item)
    parts = _input_parts(content)
    return None if parts is None else {**item, "content": parts}


def _output_message(item: dict[str, Any]) -> str | None:
    """The text vLLM keeps of an assistant message with list content that OpenAI's output message model
    accepts (its first part's), or None when the model refuses it (it is then read as an input message)."""
    content = item.get("content")
    if not isinstance(content, list) or item.get("status", "completed") not in _STATUSES:
        return None
    if not _is_str(item.get("id", "")) or item.get("phase") not in (None, *_PHASES):
        return None
    for part in content:
        if not isinstance(part, dict):
            return None
        kind = part.get("type")
        if kind == "output_text":
            if not _is_str(part.get("text")) or not isinstance(part.get("annotations", []), list):
                return None
        elif kind != "refusal" or not _is_str(part.get("refusal")):
            return None
    if not content or content[0].get("type") != "output_text":
        raise AgentInputError("an assistant message whose first part is not output_text cannot be rendered")
    return str(content[0]["text"])


def _function_call(item: Mapping[str, Any]) -> dict[str, Any]:
    args, call_id, name, ns = (
        item.get("arguments"),
        item.get("call_id"),
        item.get("name"),
        item.get("namespace"),
    )
    if not (
        _is_str(args) and _is_str(call_id) and _is_str(name) and _opt_str(ns) and _opt_str(item.get("id"))
    ):
        raise AgentInputError("function_call items need string 'arguments', 'call_id' and 'name'")
    if item.get("status") not in (None, *_STATUSES):
        raise AgentInputError("a function_call's status must be in_progress, completed or incomplete")
    full = f"{ns}__{name}" if ns else name
    return {"id": call_id, "function": {"name": full, "arguments": args}, "type": "function"}


def _custom_call(item: Mapping[str, Any]) -> dict[str, Any]:
    call_id, name, payload = item.get("call_id"), item.get("name"), item.get("input")
    if not (_is_str(call_id) and _is_str(name) and _is_str(payload) and _opt_str(item.get("id"))):
        raise AgentInputError("custom_tool_call items need string 'call_id', 'name' and 'input'")
    arguments = json.dumps({"input": payload or ""}, ensure_ascii=False)
    return {"id": call_id, "function": {"name": name, "arguments": arguments}, "type": "function"}


def _texts(v: object, kind: str) -> bool:
    return isinstance(v, list) and all(
        isinstance(s, dict) and _is_str(s.get("text")) and s.get("type") == kind for s in v
    )


def _reasoning(item: Mapping[str, Any]) -> str:
    summary, content = item.get("summary"), item.get("content")
    if not _texts(summary, "summary_text") or not (content is None or _texts(content, "reasoning_text")):
        raise AgentInputError("reasoning items need a 'summary' list of {type: summary_text, text}")
    if not _opt_str(item.get("encrypted_content")) or item.get("status") not in (None, *_STATUSES):
        raise AgentInputError("a reasoning item's encrypted_content must be a string, its status valid")
    if item.get("encrypted_content"):
        raise AgentInputError("Encrypted content is not supported.")
    assert isinstance(summary, list)
    if content:
        return str(content[0]["text"])
    return str(summary[0]["text"]) if summary else ""


def _tool_output(item: Mapping[str, Any]) -> Message:
    output = item.get("output")
    parts = output if isinstance(output, str) else _input_parts(output)
    if parts is None or not _opt_str(item.get("call_id")) or not _opt_str(item.get("id")):
        raise AgentInputError(
            f"{item.get('type')} items need a string 'call_id' and a string or parts 'output'"
        )
    return {"role": "tool", "content": parts, "tool_call_id": item.get("call_id")}


# -- the conversion (construct_input_messages) -------------------------------------------------------------


def _merge(prev: Message | None, key: str, value: Any) -> bool:
    """Put ``value`` under ``key`` of the previous message when it is an assistant message without one
    (tool calls are appended); False when a new message is needed."""
    if prev is None or prev.get("role") != "assistant":
        return False
    if key == "tool_calls":
        calls = prev.get("tool_calls")
        if calls is None:
            prev["tool_calls"] = [value]
            return True
        calls.append(value)
        return True
    if prev.get(key) is None:
        prev[key] = value
        return True
    return False


def _item_message(item: object, prev: Message | None) -> Message | None:
    """One input item as a new chat message, or None when it was merged into ``prev``."""
    if not isinstance(item, dict):
        raise AgentInputError("every input item must be an object")
    kind = item.get("type")
    if kind in ("function_call", "custom_tool_call"):
        call = _function_call(item) if kind == "function_call" else _custom_call(item)
        return None if _merge(prev, "tool_calls", call) else {"role": "assistant", "tool_calls": [call]}
    if kind == "reasoning":
        thought = _reasoning(item)
        return None if _merge(prev, "reasoning", thought) else {"role": "assistant", "reasoning": thought}
    if kind in ("function_call_output", "custom_tool_call_output"):
        return _tool_output(item)
    if kind in (None, "message") and item.get("role") == "assistant":
        text = _output_message(item) if kind == "message" else None
        if text is None:
            easy = _message_item(item)
            if easy is None:
                raise AgentInputError("an assistant message item needs string or input-part content")
            content = easy["content"]
            text = content if isinstance(content, str) else content[0].get("text") if content else None
            if text is None:
                return easy
        return None if _merge(prev, "content", text) else {"role": "assistant", "content": text}
    if kind in (None, "message"):
        msg = _message_item(item)
        if msg is None:
            raise AgentInputError("a message item needs a known role and string or input-part content")
        return msg
    raise AgentInputError(_UNRENDERED.format(kind))


def continues_final(items: object) -> bool:
    """vLLM continues the last input item instead of starting a new answer when it is a message (an
    assistant output message defaults to "completed") or a reasoning item whose status is in_progress or
    incomplete."""
    if not isinstance(items, list) or not items or not isinstance(items[-1], dict):
        return False
    last = items[-1]
    return last.get("type", "message") in ("message", "reasoning") and last.get("status") in _CONTINUED


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


def responses_messages(
    instructions: object,
    items: object,
    *,
    previous_messages: Sequence[Mapping[str, Any]] | None = None,
    previous_output: Sequence[Mapping[str, Any]] | None = None,
) -> list[Message]:
    """The chat messages vLLM builds for ``instructions`` and the ``input`` items, after the stored
    conversation of a ``previous_response_id`` (its messages, its output items) when there is one."""
    messages: list[Message] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if previous_messages is not None:
        messages.extend(dict(m) for m in previous_messages if m.get("role") != "system")
    if previous_output is not None:
        messages.extend(response_output_messages(previous_output))
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
        return messages
    if not isinstance(items, list):
        raise AgentInputError("'input' must be a string or a list of items")
    new: list[Message] = []
    for item in items:
        msg = _item_message(item, new[-1] if new else None)
        if msg is not None:
            new.append(msg)
    messages.extend(new)
    return messages


# -- tools (construct_tool_dicts) --------------------------------------------------------------------------

_CUSTOM_PARAMETERS = {
    "type": "object",
    "properties": {"input": {"type": "string", "description": "The freeform text payload for this tool."}},
    "required": ["input"],
    "additionalProperties": False,
}


def responses_tools(tools: object) -> list[dict[str, Any]] | None:
    """The function tools the chat template is shown for the request's (already checked) tools, as vLLM
    dumps them: ``{"type": "function", "function": {name, description, parameters[, strict]
    [, defer_loading]}}``; None for no tools at all (built-in tools only give an empty list)."""
    if not isinstance(tools, list) or not tools:
        return None
    out: list[dict[str, Any]] = []
    for tool in tools:
        kind = tool.get("type")
        if kind == "function":
            out.append(_function_tool(tool, tool["name"]))
        elif kind == "namespace":
            for sub in tool["tools"]:
                if sub.get("type") == "function":
                    out.append(_function_tool(sub, f"{tool['name']}__{sub['name']}"))
        elif kind == "custom":
            fn = {
                "name": tool["name"],
                "description": tool.get("description"),
                "parameters": _CUSTOM_PARAMETERS,
            }
            out.append({"type": "function", "function": json.loads(json.dumps(fn))})
    return out


def _function_tool(tool: Mapping[str, Any], name: str) -> dict[str, Any]:
    fn: dict[str, Any] = {
        "name": name,
        "description": tool.get("description"),
        "parameters": tool.get("parameters"),
    }
    for key in ("strict", "defer_loading"):
        if tool.get(key) is not None:
            fn[key] = tool[key]
    return {"type": "function", "function": fn}
