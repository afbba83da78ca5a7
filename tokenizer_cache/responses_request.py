"""A ``/v1/responses`` body read the way vLLM 0.33's Responses path reads it before rendering (non-Harmony
models): ``plan_responses(body, options, server_template)`` returns the ``ChatPlan`` that
``ChatRenderer.render_plan`` renders, like a chat request's, with the Responses path's own differences:

- its own request model (``entrypoints/openai/responses/protocol.py``): ``input`` a string or items
  (``agent_inputs``), its ``tool_choice`` and ``reasoning`` rules, ``truncation``;
- no chat message validation: the converted messages go to the chat parser as they are;
- tools from ``agent_inputs.responses_tools``; no tool parser is needed for ``tool_choice``;
- template arguments as on chat, with the last item's continuation (``agent_inputs.continues_final``);
  the content format is detected on the server's template;
- tokenization **with** special tokens (vLLM's ``TokenizeParams`` default), truncated to
  ``max_model_len - 1`` unless ``truncation`` is "disabled";
- ``kv_transfer_params.prompt_token_ids``: the prompt as given, as on chat.

Every rule, with its source: docs/parity.md, section 8.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .agent_inputs import AgentInputError, continues_final, responses_messages, responses_tools
from .chat_request import ChatPlan, TokenizeSpec, has_media, merge_kwargs
from .config import RenderOptions
from .errors import RequestValidationError
from .request_schema import Invalid, lax_bool, lax_int

__all__ = ["ResponsesPlan", "plan_responses"]

# OpenAI's reasoning efforts (the Responses request's ``reasoning.effort``).
_EFFORTS = (None, "none", "minimal", "low", "medium", "high", "xhigh", "max")
_CHOICE_STRINGS = ("none", "auto", "required")
# Tool types of OpenAI's Tool union with the fields each needs; none of them is shown to the model.
_BUILTIN_REQUIRED: dict[str, tuple[str, ...]] = {
    "file_search": ("vector_store_ids",),
    "computer_use_preview": ("display_height", "display_width", "environment"),
    "computer": (),
    "web_search": (),
    "web_search_2025_08_26": (),
    "web_search_preview": (),
    "web_search_preview_2025_03_11": (),
    "mcp": ("server_label",),
    "code_interpreter": ("container",),
    "image_generation": (),
    "local_shell": (),
    "shell": (),
    "apply_patch": (),
    "tool_search": (),
}
_CHOICE_TYPES = frozenset(
    {
        "file_search",
        "web_search_preview",
        "computer_use_preview",
        "computer",
        "web_search_preview_2025_03_11",
        "image_generation",
        "code_interpreter",
        "computer_use",
    }
)


class ResponsesPlan(ChatPlan):
    """A ``ChatPlan`` with the converted messages as vLLM stores them for a later ``previous_response_id``."""


def _check_function(tool: Mapping[str, Any], where: str) -> None:
    if not isinstance(tool.get("name"), str):
        raise AgentInputError(f"{where}: a function tool needs a string 'name'", "tools")
    params = tool.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise AgentInputError(f"{where}: 'parameters' must be an object", "tools")
    if tool.get("description") is not None and not isinstance(tool.get("description"), str):
        raise AgentInputError(f"{where}: 'description' must be a string", "tools")
    for key in ("strict", "defer_loading"):
        if tool.get(key) is not None:
            try:
                lax_bool(tool[key])
            except Invalid:
                raise AgentInputError(f"{where}: {key!r} must be a boolean", "tools") from None


def _check_tools(raw: object) -> list[dict[str, Any]]:
    """The request's tools as OpenAI's Tool union accepts them (400 otherwise; null too)."""
    if not isinstance(raw, list):
        raise AgentInputError("'tools' must be a list", "tools")
    out = []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise AgentInputError(f"{where} must be an object", "tools")
        kind = tool.get("type")
        if kind == "function":
            _check_function(tool, where)
            tool = {
                **tool,
                **{k: lax_bool(tool[k]) for k in ("strict", "defer_loading") if tool.get(k) is not None},
            }
        elif kind == "custom":
            if not isinstance(tool.get("name"), str):
                raise AgentInputError(f"{where}: a custom tool needs a string 'name'", "tools")
            fmt = tool.get("format")
            if isinstance(fmt, dict) and fmt.get("type") == "grammar":
                raise AgentInputError(
                    "Custom tools with a grammar format are not supported; only free-form text custom tools "
                    "are accepted.",
                    "tools",
                )
        elif kind == "namespace":
            subs = tool.get("tools")
            if not isinstance(tool.get("name"), str) or not isinstance(subs, list):
                raise AgentInputError(f"{where}: a namespace tool needs a 'name' and a 'tools' list", "tools")
            for j, sub in enumerate(subs):
                if not isinstance(sub, dict) or sub.get("type") not in ("function", "custom"):
                    raise AgentInputError(f"{where}.tools[{j}] must be a function or custom tool", "tools")
                if sub.get("type") == "function":
                    _check_function(sub, f"{where}.tools[{j}]")
                elif not isinstance(sub.get("name"), str):
                    raise AgentInputError(f"{where}.tools[{j}]: a custom tool needs a 'name'", "tools")
        elif kind in _BUILTIN_REQUIRED:
            missing = [k for k in _BUILTIN_REQUIRED[kind] if k not in tool]
            if missing:
                raise AgentInputError(f"{where}: a {kind} tool needs {', '.join(missing)}", "tools")
        else:
            raise AgentInputError(f"{where}: unknown tool type {kind!r}", "tools")
        out.append(tool)
    return out


def _resolve_named(name: str, tools: Sequence[Mapping[str, Any]]) -> str:
    exact: set[str] = set()
    local: dict[str, list[str]] = {}
    for tool in tools:
        if tool.get("type") == "namespace":
            for sub in tool["tools"]:
                flat = f"{tool['name']}__{sub['name']}"
                exact.add(flat)
                local.setdefault(sub["name"], []).append(flat)
        elif isinstance(tool.get("name"), str):
            exact.add(tool["name"])
    if name in exact:
        return name
    found = local.get(name, [])
    if len(found) == 1:
        return found[0]
    if found:
        raise AgentInputError(f"Tool choice '{name}' is ambiguous", "tool_choice")
    raise AgentInputError("Tool choice 'function' not found in 'tools' parameter.", "tool_choice")


def _tool_choice(body: Mapping[str, Any], tools: list[dict[str, Any]]) -> object:
    """``tool_choice`` as the request model leaves it (``check_tool_usage``, then the ToolChoice union)."""
    choice = body.get("tool_choice", "auto")
    named = isinstance(choice, dict) and choice.get("type") in ("function", "custom")
    if not tools:
        if choice in ("auto", "none"):
            return "none"
        if choice == "required" or named:
            raise AgentInputError("Tool choice 'required' or a named tool needs 'tools'", "tool_choice")
    elif named:
        name = choice.get("name")
        if not name or not isinstance(name, str):
            raise AgentInputError("Tool choice 'function' not found in 'tools' parameter.", "tool_choice")
        choice = {**choice, "name": _resolve_named(name, tools)}
    if isinstance(choice, str):
        if choice not in _CHOICE_STRINGS:
            raise AgentInputError(f"invalid tool_choice {choice!r}", "tool_choice")
        return choice
    if not isinstance(choice, dict):
        raise AgentInputError("invalid tool_choice", "tool_choice")
    kind = choice.get("type")
    if kind == "allowed_tools":
        if choice.get("mode") not in ("auto", "required") or not isinstance(choice.get("tools"), list):
            raise AgentInputError("invalid allowed_tools tool_choice", "tool_choice")
    elif kind == "mcp":
        if not isinstance(choice.get("server_label"), str):
            raise AgentInputError("invalid mcp tool_choice", "tool_choice")
    elif kind not in ("function", "custom", "apply_patch", "shell") and kind not in _CHOICE_TYPES:
        raise AgentInputError(f"invalid tool_choice type {kind!r}", "tool_choice")
    return choice


def _optional_int(body: Mapping[str, Any], key: str) -> int | None:
    v = body.get(key)
    try:
        return None if v is None else lax_int(v)
    except Invalid:
        raise AgentInputError(f"{key} must be an integer", key) from None


def plan_responses(
    body: Mapping[str, Any],
    options: RenderOptions,
    server_template: str | None,
    *,
    previous_messages: Sequence[Mapping[str, Any]] | None = None,
    previous_output: Sequence[Mapping[str, Any]] | None = None,
) -> ResponsesPlan:
    """Read a Responses body (raises ``AgentInputError``, ``RequestValidationError``)."""
    if not isinstance(body, Mapping):
        raise AgentInputError("the request body must be a JSON object", "body")
    if body.get("prompt") is not None:
        raise AgentInputError("prompt template is not supported", "prompt")
    if body.get("previous_response_id") is not None and previous_messages is None and previous_output is None:
        # the conversation is stored on one instance (vLLM's stateless render endpoint refuses it too)
        raise AgentInputError("previous_response_id needs the stored conversation", "previous_response_id")
    if "input" not in body or not isinstance(body["input"], (str, list)):
        raise AgentInputError("'input' must be a string or a list of items")
    salt = body.get("cache_salt")
    if salt is not None and (
        not isinstance(salt, str) or not salt or len(salt) > 128 or any(c in salt for c in "@/\\\x00")
    ):
        raise AgentInputError("cache_salt must be a non-empty string of at most 128 characters", "cache_salt")
    if body.get("background") and not body.get("store", True):
        raise AgentInputError("background can only be used when `store` is true", "background")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise AgentInputError("'instructions' must be a string", "instructions")
    tools = _check_tools(body.get("tools", []))
    choice = _tool_choice(body, tools)
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise AgentInputError("'reasoning' must be an object", "reasoning")
    effort = (reasoning or {}).get("effort")
    if effort not in _EFFORTS:
        raise AgentInputError(f"reasoning.effort must be one of {list(_EFFORTS[1:])}", "reasoning")
    truncation = body.get("truncation", "disabled")
    if truncation not in ("auto", "disabled", None):
        raise AgentInputError("truncation must be 'auto' or 'disabled'", "truncation")
    max_output = _optional_int(body, "max_output_tokens")
    user_kwargs = body.get("chat_template_kwargs")
    if user_kwargs is not None and not isinstance(user_kwargs, dict):
        raise AgentInputError("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    items = body["input"]
    messages = responses_messages(
        instructions, items, previous_messages=previous_messages, previous_output=previous_output
    )

    # Server checks (renderers/online_renderer.py), then the template arguments.
    if (
        options.trust_request_chat_template is False
        and user_kwargs
        and user_kwargs.get("chat_template") is not None
    ):
        raise RequestValidationError(
            "Chat template is passed with request, but --trust-request-chat-template is not set."
        )
    if options.trust_request_mm_kwargs is False and (
        body.get("mm_processor_kwargs") or body.get("media_io_kwargs")
    ):
        raise RequestValidationError(
            "Per-request mm_processor_kwargs/media_io_kwargs need --trust-request-mm-kwargs"
        )
    if max_output is not None and options.max_model_len is not None and max_output > options.max_model_len:
        raise RequestValidationError(f"max_output_tokens={max_output} cannot be greater than max_model_len")
    exclude = choice == "none" and options.exclude_tools_when_tool_choice_none
    tool_dicts = None if exclude else responses_tools(tools)
    cont = continues_final(items)
    if effort is not None and options.reasoning_effort_map:
        effort = options.reasoning_effort_map.get(effort, effort)
    extra: dict[str, Any] = {
        "add_generation_prompt": not cont,
        "continue_final_message": cont,
        "reasoning_effort": effort,
    }
    if effort is not None and "enable_thinking" not in (user_kwargs or {}):
        extra["enable_thinking"] = effort != "none"
    request_kwargs = merge_kwargs(user_kwargs, extra)
    defaults = merge_kwargs(options.default_chat_template_kwargs, request_kwargs)
    kwargs = merge_kwargs(merge_kwargs(defaults, {"tools": tool_dicts, "tokenize": False}), request_kwargs)
    kwargs = merge_kwargs(kwargs, {"chat_template": server_template, "return_dict": False})
    tokenize = TokenizeSpec(True, None if truncation == "disabled" else -1, None)
    reuse = _reused_ids(body, messages)
    return ResponsesPlan(messages, kwargs, server_template, tokenize, reuse)


def _reused_ids(body: Mapping[str, Any], messages: list[dict[str, Any]]) -> list[int] | None:
    kv = body.get("kv_transfer_params")
    if not isinstance(kv, Mapping) or kv.get("prompt_token_ids") is None or has_media(messages):
        return None
    ids = kv["prompt_token_ids"]
    if not isinstance(ids, list) or not ids or any(type(x) is not int or x < 0 for x in ids):
        raise RequestValidationError(
            "`kv_transfer_params['prompt_token_ids']` must be a non-empty list of non-negative integers."
        )
    return list(ids)
