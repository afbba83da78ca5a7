"""A chat request body, read the way vLLM 0.33's OpenAI server reads it before rendering.

``plan_chat(body, options)`` checks the fields that decide the prompt and computes what the template will
be called with; ``ChatRenderer.render_plan`` (``chat.py``) then renders it.  In vLLM's order:

1. the request model: ``messages`` and each field's type and bounds (``request_schema`` for messages);
2. tools (``[]`` refused; each passed on as vLLM dumps it);
3. ``tool_choice`` ("auto" when absent with tools; a named choice must name a tool; the
   ``--exclude-tools-when-tool-choice-none`` flag);
4. trusted request templates and multimodal kwargs (``--trust-request-*``);
5. ``kv_transfer_params.prompt_token_ids`` (a disaggregated decode leg's prompt, used as given);
6. template arguments, lowest priority first: the server's defaults, tools, the request's
   ``chat_template_kwargs`` merged with its own fields (a null or "auto" value never overrides).

Server flags come in ``RenderOptions``.  Every rule, with its source: docs/parity.md, sections 1-3.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .config import RenderOptions
from .errors import RequestValidationError
from .request_schema import Invalid, lax_bool, lax_int, validate_messages

__all__ = ["ChatPlan", "TokenizeSpec", "has_media", "merge_kwargs", "plan_chat", "tokenize_spec"]

_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_TEXT_TYPES = frozenset({"text", "input_text", "output_text", "refusal", "thinking", "tool_reference"})
_MEDIA_KEYS = frozenset(
    {
        "input_image",
        "image_url",
        "image_embeds",
        "audio_embeds",
        "video_embeds",
        "prompt_embeds",
        "image_pil",
        "audio_url",
        "input_audio",
        "video_url",
    }
)


@dataclass(frozen=True)
class TokenizeSpec:
    """How the rendered text is tokenized (vLLM's ``TokenizeParams`` fields that change the ids)."""

    add_special_tokens: bool
    truncate_prompt_tokens: int | None = None
    truncation_side: str | None = None


@dataclass
class ChatPlan:
    """What ``plan_chat`` read from a chat request."""

    messages: list[dict[str, Any]]
    """Validated messages (``request_schema``)."""
    kwargs: dict[str, Any]
    """Template arguments as vLLM passes them to ``safe_apply_chat_template`` (step 6)."""
    format_template: str | None
    """The template vLLM detects the content format with: the request's, else the server's (None: the
    tokenizer's own).  Unlike rendering, it ignores a template given in ``chat_template_kwargs``."""
    tokenize: TokenizeSpec
    reuse_ids: list[int] | None
    """Decode-side ids from ``kv_transfer_params``: the prompt as given, nothing rendered."""


def merge_kwargs(defaults: Mapping[str, Any] | None, overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """``defaults`` updated with the overrides that are neither null nor "auto" (vLLM's merge)."""
    out = dict(defaults or {})
    out.update((k, v) for k, v in (overrides or {}).items() if v is not None and not _is_auto(v))
    return out


def _is_auto(v: Any) -> bool:
    return isinstance(v, str) and v == "auto"


def _field(body: Mapping[str, Any], key: str, check: Any, default: Any) -> Any:
    if key not in body:
        return default
    try:
        return check(body[key])
    except Invalid as e:
        raise RequestValidationError(f"{key} must be {e}") from None


def _optional(check: Any) -> Any:
    return lambda v: None if v is None else check(v)


def _string(v: Any) -> str:
    if type(v) is not str:
        raise Invalid("a string")
    return v


def _object(v: Any) -> dict[str, Any]:
    if not isinstance(v, Mapping) or any(type(k) is not str for k in v):
        raise Invalid("an object")
    return dict(v)


def _documents(v: Any) -> list[dict[str, str]]:
    if type(v) is not list:
        raise Invalid("a list of objects with string values")
    for d in v:
        if not isinstance(d, Mapping) or any(type(k) is not str or type(x) is not str for k, x in d.items()):
            raise Invalid("a list of objects with string values")
    return [dict(d) for d in v]


def tokenize_spec(body: Mapping[str, Any], add_special_default: bool) -> TokenizeSpec:
    """``add_special_tokens``, ``truncate_prompt_tokens`` and ``truncation_side`` (chat and completions)."""
    truncate = _field(body, "truncate_prompt_tokens", _optional(lax_int), None)
    if truncate is not None and truncate < -1:
        raise RequestValidationError("truncate_prompt_tokens must be >= -1")
    side = _field(body, "truncation_side", _optional(_string), None)
    if side not in (None, "left", "right"):
        raise RequestValidationError("truncation_side must be 'left' or 'right'")
    return TokenizeSpec(_field(body, "add_special_tokens", lax_bool, add_special_default), truncate, side)


def check_common(body: Mapping[str, Any], options: RenderOptions) -> None:
    """Validators chat and completions requests share: stream options, cache salt, max tokens."""
    if body.get("stream_options") and not body.get("stream"):
        raise RequestValidationError("Stream options can only be defined when `stream=True`.")
    salt = body.get("cache_salt")
    if salt is not None and (
        not isinstance(salt, str) or not salt or len(salt) > 128 or any(c in salt for c in "@/\\\x00")
    ):
        raise RequestValidationError("cache_salt must be a non-empty string of at most 128 characters")
    for key in ("max_tokens", "max_completion_tokens"):
        value = _field(body, key, _optional(lax_int), None)
        if value is not None and options.max_model_len is not None and value > options.max_model_len:
            raise RequestValidationError(f"{key}={value} cannot be greater than max_model_len")


def has_media(messages: Any) -> bool:
    """vLLM's test for content that must be rendered (no id reuse): media keys or non-text part types."""
    if not isinstance(messages, list):
        return False
    for msg in messages:
        if not isinstance(msg, Mapping):
            continue
        for key in ("reasoning", "reasoning_content"):
            r = msg.get(key)
            if isinstance(r, Mapping) and r.get("type") == "prompt_embeds":
                return True
        content = msg.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            if isinstance(part, Mapping):
                kind = part.get("type", "text")
                if (
                    any(k in part for k in _MEDIA_KEYS)
                    or not isinstance(kind, str)
                    or kind not in _TEXT_TYPES
                ):
                    return True
    return False


def _tools(raw: Any) -> list[dict[str, Any]] | None:
    if raw is None:
        return None
    if type(raw) is not list:
        raise RequestValidationError("tools must be a list")
    if not raw:
        raise RequestValidationError("`tools` must not be an empty array.")
    out = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, Mapping):
            raise RequestValidationError(f"tools[{i}] must be an object")
        if tool.get("type", "function") != "function":
            raise RequestValidationError(f"tools[{i}].type must be 'function'")
        fn = tool.get("function")
        if not isinstance(fn, Mapping) or type(fn.get("name")) is not str:
            raise RequestValidationError(f"tools[{i}].function must be an object with a string 'name'")
        try:
            desc = _optional(_string)(fn.get("description"))
            params = _optional(_object)(fn.get("parameters"))
            strict = _optional(lax_bool)(fn.get("strict"))
            fn_defer = _optional(lax_bool)(fn.get("defer_loading"))
            defer = _optional(lax_bool)(tool.get("defer_loading"))
        except Invalid as e:
            raise RequestValidationError(f"tools[{i}]: a field must be {e}") from None
        if defer is not None and fn_defer is None:
            fn_defer = defer
        dumped_fn: dict[str, Any] = {"name": fn["name"], "description": desc, "parameters": params}
        if strict is not None:
            dumped_fn["strict"] = strict
        if fn_defer is not None:
            dumped_fn["defer_loading"] = fn_defer
        dumped: dict[str, Any] = {"type": "function", "function": dumped_fn}
        if defer is not None:
            dumped["defer_loading"] = defer
        out.append(dumped)
    return out


def _tool_choice(body: Mapping[str, Any], tools: list[dict[str, Any]] | None) -> Any:
    raw_tools = body.get("tools")
    choice = body.get("tool_choice", "auto" if raw_tools else "none")
    if choice == "none" or choice is None:
        return choice
    if raw_tools is None:
        raise RequestValidationError("When using `tool_choice`, `tools` must be set.")
    if isinstance(choice, Mapping):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if not isinstance(name, str) or not name:
            raise RequestValidationError(
                "tool_choice must name a function: {'type': 'function', 'function': {'name': ...}}"
            )
        if choice.get("type", "function") != "function":
            raise RequestValidationError("tool_choice.type must be 'function'")
        if not any(t["function"]["name"] == name for t in tools or ()):
            raise RequestValidationError(
                "The tool specified in `tool_choice` does not match any of the specified `tools`"
            )
        return choice
    if choice not in ("auto", "required"):
        raise RequestValidationError(f"Invalid value for `tool_choice`: {choice}!")
    return choice


def plan_chat(
    body: Mapping[str, Any],
    options: RenderOptions,
    server_template: str | None,
    assigned: Mapping[str, Any] | None = None,
) -> ChatPlan:
    """Read a chat request body (raises ``RequestValidationError``, ``ChatTemplateError``).  ``assigned``:
    ``tools`` (dumped), ``tool_choice`` and ``reasoning_effort`` set on the validated request afterwards,
    unchecked (vLLM's Messages conversion does so)."""
    if not isinstance(body, Mapping):
        raise RequestValidationError("the request body must be a JSON object")
    raw_messages = body.get("messages")
    if type(raw_messages) is not list:
        raise RequestValidationError("messages must be a list of message objects")
    check_common(body, options)
    if body.get("continue_final_message") and body.get("add_generation_prompt"):
        raise RequestValidationError(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        )
    messages = validate_messages(raw_messages)
    tools = _tools(body.get("tools"))
    choice = _tool_choice(body, tools)
    if assigned:
        tools = assigned.get("tools", tools)
        choice = assigned.get("tool_choice", choice)
        named = choice.get("function", {}).get("name") if isinstance(choice, Mapping) else None
        if named is not None and tools is not None and not any(t["function"]["name"] == named for t in tools):
            # not checked by the request model, then refused by the tool parser (which reads given tools)
            raise RequestValidationError(f"Tool {named!r} has not been passed in `tools`.")
    add_generation_prompt = _field(body, "add_generation_prompt", lax_bool, True)
    continue_final_message = _field(body, "continue_final_message", lax_bool, False)
    echo = _field(body, "echo", lax_bool, False)
    documents = _field(body, "documents", _optional(_documents), None)
    request_template = _field(body, "chat_template", _optional(_string), None)
    user_kwargs = _field(body, "chat_template_kwargs", _optional(_object), None)
    effort = _field(body, "reasoning_effort", _optional(_string), None)
    if effort is not None and effort not in _EFFORTS:
        raise RequestValidationError(f"reasoning_effort must be one of {list(_EFFORTS)}")
    if assigned and "reasoning_effort" in assigned:
        effort = assigned["reasoning_effort"]
    tok = tokenize_spec(body, add_special_default=False)

    if options.tool_parser is False and choice not in (None, "none"):
        raise RequestValidationError(
            f"tool_choice={choice!r} requires --enable-auto-tool-choice and --tool-call-parser"
        )
    tool_dicts = (
        None if tools is None or (choice == "none" and options.exclude_tools_when_tool_choice_none) else tools
    )
    if options.trust_request_chat_template is False and (
        request_template is not None or (user_kwargs and user_kwargs.get("chat_template") is not None)
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

    reuse = _reused_ids(body, echo, raw_messages)
    if effort is not None and options.reasoning_effort_map:
        effort = options.reasoning_effort_map.get(effort, effort)
    extra: dict[str, Any] = {
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
        "documents": documents,
        "reasoning_effort": effort,
    }
    if effort is not None and "enable_thinking" not in (user_kwargs or {}):
        extra["enable_thinking"] = effort != "none"
    defaults = merge_kwargs(options.default_chat_template_kwargs, {"tools": tool_dicts, "tokenize": False})
    kwargs = merge_kwargs(defaults, merge_kwargs(user_kwargs, extra))
    template = request_template or server_template
    kwargs = merge_kwargs(kwargs, {"chat_template": template, "return_dict": False})
    return ChatPlan(messages, kwargs, template, tok, reuse)


def _reused_ids(body: Mapping[str, Any], echo: bool, raw_messages: list[Any]) -> list[int] | None:
    kv = body.get("kv_transfer_params")
    if not isinstance(kv, Mapping) or kv.get("prompt_token_ids") is None or echo or has_media(raw_messages):
        return None
    ids = kv["prompt_token_ids"]
    if not isinstance(ids, list) or not ids or any(type(x) is not int or x < 0 for x in ids):
        raise RequestValidationError(
            "`kv_transfer_params['prompt_token_ids']` must be a non-empty list of non-negative integers."
        )
    return list(ids)
