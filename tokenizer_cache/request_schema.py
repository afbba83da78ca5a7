"""The message types vLLM 0.33's chat request accepts, and the validation of ``messages`` against them.

``messages`` is a union of OpenAI's six message types (developer, system, user, assistant, tool, function)
and vLLM's catch-all type (any role), validated with pydantic's rules (``typed_dicts``).  Which member
wins decides what reaches the template and which requests are refused.  OpenAI's members declare content
parts and tool calls as ``Iterable``: checked only when vLLM reads them, against OpenAI's narrower part
types.  So ``{"role": "user", "content": [{"type": "text", ...}]}`` goes to vLLM's member (4 fields set
against 2) and is accepted, while ``[{"type": "input_text", ...}]`` alone ties (2 against 2), goes to
OpenAI's user member, and fails when read: a 400.

Validated dicts keep vLLM's key order (declared keys in declaration order, then extras in input order):
templates that serialise a tool call or a content part see them in that order.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .errors import RequestValidationError
from .typed_dicts import (
    TD,
    AnyValue,
    Bool,
    ByRole,
    DictOf,
    Invalid,
    IterableOf,
    LazyParts,
    ListOf,
    Lit,
    Node,
    Null,
    OneOf,
    Str,
    lax_bool,
    lax_int,
    optional,
)

__all__ = [
    "Invalid",
    "LazyParts",
    "lax_bool",
    "lax_int",
    "materialize",
    "validate_message",
    "validate_messages",
    "validate_tool_calls",
]


# -- the schemas (openai 3.x types and vLLM 0.33's additions) --------------------------------------

_S, _B, _ANY = Str(), Bool(), AnyValue()
_EMBEDS = optional(OneOf((_S, DictOf(_ANY))))
_BREAKPOINT = TD(
    "PromptCacheBreakpoint", (("mode", Lit(("explicit",)), True), ("ttl", Lit(("30m", "12h")), False))
)
_TEXT = TD(
    "TextPart",
    (("text", _S, True), ("type", Lit(("text",)), True), ("prompt_cache_breakpoint", _BREAKPOINT, False)),
)
_IMAGE = TD(
    "ImagePart",
    (
        (
            "image_url",
            TD("ImageURL", (("url", _S, True), ("detail", Lit(("auto", "low", "high", "original")), False))),
            True,
        ),
        ("type", Lit(("image_url",)), True),
        ("prompt_cache_breakpoint", _BREAKPOINT, False),
    ),
)
_INPUT_AUDIO = TD(
    "InputAudioPart",
    (
        (
            "input_audio",
            TD("InputAudio", (("data", _S, True), ("format", Lit(("wav", "mp3")), True))),
            True,
        ),
        ("type", Lit(("input_audio",)), True),
        ("prompt_cache_breakpoint", _BREAKPOINT, False),
    ),
)
_FILE = TD(
    "File",
    (
        (
            "file",
            TD("FileFile", (("file_data", _S, False), ("file_id", _S, False), ("filename", _S, False))),
            True,
        ),
        ("type", Lit(("file",)), True),
        ("prompt_cache_breakpoint", _BREAKPOINT, False),
    ),
)
_REFUSAL = TD("RefusalPart", (("refusal", _S, True), ("type", Lit(("refusal",)), True)))
_URL = TD("URL", (("url", _S, True),))


def _common_part(p: Any) -> tuple[dict[str, Any], int] | None:
    """The union's outcome for the commonest content parts, without trying its members; None otherwise.

    Exactly these (any key order): ``{type: text, text: str}`` (TextPart, 2 fields set); ``{type:
    image_url, image_url: {url: str}}`` with or without a ``uuid`` (ImagePart, 3 set, the uuid an extra);
    ``{type: image_url, image_url: null, uuid: str}`` (SimpleImagePart, 2 set: ImagePart refuses the null
    URL object).  The output dicts are new, in the member's key order (tests hold this to ``check_all``)."""
    if type(p) is not dict or type(kind := p.get("type")) is not str:
        return None
    n = len(p)
    if kind == "text":
        text = p.get("text")
        return ({"text": text, "type": "text"}, 2) if n == 2 and type(text) is str else None
    if kind != "image_url" or not 2 <= n <= 3 or "image_url" not in p or (n == 3 and "uuid" not in p):
        return None
    obj = p["image_url"]
    if type(obj) is dict:
        url = obj.get("url")
        if len(obj) != 1 or type(url) is not str:
            return None
        out: dict[str, Any] = {"image_url": {"url": url}, "type": "image_url"}
        if n == 3:
            out["uuid"] = p["uuid"]
        return out, 3
    uuid = p.get("uuid")
    if obj is None and type(uuid) is str:
        return {"image_url": None, "uuid": uuid, "type": "image_url"}, 2
    return None


_VLLM_PARTS = OneOf(
    (
        _TEXT,
        _IMAGE,
        _INPUT_AUDIO,
        _FILE,
        TD("AudioPart", (("audio_url", _URL, True), ("type", Lit(("audio_url",)), True))),
        TD("VideoPart", (("video_url", _URL, True), ("type", Lit(("video_url",)), True))),
        _REFUSAL,
        TD("PILImagePart", (("image_pil", optional(_ANY), False), ("uuid", optional(_S), False))),
        TD("SimpleImagePart", (("image_url", optional(_S), False), ("uuid", optional(_S), False))),
        TD(
            "ImageEmbedsPart",
            (
                ("image_embeds", _EMBEDS, False),
                ("type", Lit(("image_embeds",)), True),
                ("uuid", optional(_S), False),
            ),
        ),
        TD(
            "AudioEmbedsPart",
            (
                ("audio_embeds", _EMBEDS, False),
                ("type", Lit(("audio_embeds",)), True),
                ("uuid", optional(_S), False),
            ),
        ),
        TD(
            "VideoEmbedsPart",
            (
                ("video_embeds", _EMBEDS, False),
                ("audio_embeds", _EMBEDS, False),
                ("type", Lit(("video_embeds",)), True),
                ("uuid", optional(_S), False),
            ),
        ),
        TD("PromptEmbedsPart", (("data", _S, True), ("type", Lit(("prompt_embeds",)), True))),
        TD("SimpleAudioPart", (("audio_url", optional(_S), False),)),
        TD("SimpleVideoPart", (("video_url", optional(_S), False), ("uuid", optional(_S), False))),
        TD("ToolReferencePart", (("name", _S, False), ("type", Lit(("tool_reference",)), False))),
        _S,
        TD(
            "ThinkingPart",
            (("thinking", _S, True), ("closed", _B, False), ("type", Lit(("thinking",)), True)),
        ),
    ),
    common=_common_part,
)
_FUNCTION = TD("Function", (("arguments", _S, True), ("name", _S, True)))
_FUNCTION_CALL = TD(
    "FunctionToolCall", (("id", _S, True), ("function", _FUNCTION, True), ("type", Lit(("function",)), True))
)
_CUSTOM_CALL = TD(
    "CustomToolCall",
    (
        ("id", _S, True),
        ("custom", TD("Custom", (("input", _S, True), ("name", _S, True))), True),
        ("type", Lit(("custom",)), True),
    ),
)
_FUNCTION_DEF = TD(
    "FunctionDefinition",
    (
        ("name", _S, True),
        ("description", _S, False),
        ("parameters", DictOf(_ANY), False),
        ("strict", optional(_B), False),
    ),
)


def _text_only_content(required: bool = True) -> tuple[str, Node, bool]:
    return ("content", OneOf((_S, IterableOf(_TEXT))), required)


_OPENAI_MESSAGES = (
    TD(
        "DeveloperMessage",
        (_text_only_content(), ("role", Lit(("developer",)), True), ("name", _S, False)),
    ),
    TD("SystemMessage", (_text_only_content(), ("role", Lit(("system",)), True), ("name", _S, False))),
    TD(
        "UserMessage",
        (
            ("content", OneOf((_S, IterableOf(OneOf((_TEXT, _IMAGE, _INPUT_AUDIO, _FILE))))), True),
            ("role", Lit(("user",)), True),
            ("name", _S, False),
        ),
    ),
    TD(
        "AssistantMessage",
        (
            ("role", Lit(("assistant",)), True),
            ("audio", optional(TD("Audio", (("id", _S, True),))), False),
            ("content", OneOf((_S, IterableOf(OneOf((_TEXT, _REFUSAL))), Null())), False),
            (
                "function_call",
                optional(TD("FunctionCall", (("arguments", _S, True), ("name", _S, True)))),
                False,
            ),
            ("name", _S, False),
            ("refusal", optional(_S), False),
            ("tool_calls", IterableOf(OneOf((_FUNCTION_CALL, _CUSTOM_CALL))), False),
        ),
    ),
    TD("ToolMessage", (_text_only_content(), ("role", Lit(("tool",)), True), ("tool_call_id", _S, True))),
    TD(
        "FunctionMessage",
        (("content", optional(_S), True), ("name", _S, True), ("role", Lit(("function",)), True)),
    ),
)
_CUSTOM_MESSAGE = TD(
    "CustomMessage",
    (
        ("role", _S, True),
        ("content", OneOf((_S, ListOf(_VLLM_PARTS))), False),
        ("name", _S, False),
        ("tool_call_id", optional(_S), False),
        ("tool_calls", optional(ListOf(_FUNCTION_CALL)), False),
        (
            "reasoning",
            OneOf(
                (
                    _S,
                    TD(
                        "PromptEmbedsPart",
                        (("data", _S, True), ("type", Lit(("prompt_embeds",)), True)),
                    ),
                    Null(),
                )
            ),
            False,
        ),
        (
            "tools",
            optional(
                ListOf(
                    TD(
                        "FunctionTool",
                        (("function", _FUNCTION_DEF, True), ("type", Lit(("function",)), True)),
                    )
                )
            ),
            False,
        ),
        ("task", optional(_S), False),
    ),
)
_MESSAGES = ByRole(_OPENAI_MESSAGES, _CUSTOM_MESSAGE)


def validate_message(message: Any, n: int) -> dict[str, Any]:
    """Message ``n`` as vLLM's request model leaves it (raises ``RequestValidationError``).

    The request's "before" validator runs first: ``reasoning_content`` is renamed ``reasoning`` (kept only
    when ``reasoning`` is absent or null) and ``tool_calls`` that are not a list are turned into one.
    """
    if isinstance(message, Mapping):
        message = dict(message)
        rc = message.pop("reasoning_content", None)
        if rc is not None and message.get("reasoning") is None:
            message["reasoning"] = rc
        calls = message.get("tool_calls")
        if calls is not None and not isinstance(calls, list):
            if not isinstance(calls, (str, Mapping, tuple)):
                raise RequestValidationError(f"messages[{n}].tool_calls must be an array")
            message["tool_calls"] = list(calls)
        fast = _plain_text_message(message)
        if fast is not None:
            return fast
    try:
        out, _ = _MESSAGES.check(message)
    except Invalid as e:
        raise RequestValidationError(f"messages[{n}] is not a valid chat message: {e}") from None
    return dict(out)


_PLAIN_KEYS = frozenset({"role", "content", "name", "tool_call_id", "reasoning", "task"})
_NAMED_ROLES = frozenset({"developer", "system", "user", "assistant"})


def _plain_text_message(m: dict[str, Any]) -> dict[str, Any] | None:
    """The common message, decided without the union: string content and only string-or-null fields.

    Such a message validates exactly when the union would accept it: for the developer, system, user and
    assistant roles when ``name`` is a string or absent (OpenAI's member takes it, other keys ride along
    as extras); for ``tool`` when ``tool_call_id`` is a string (OpenAI's) or null/absent and the other
    fields fit vLLM's member; for any other role when they fit vLLM's member.  Which member wins changes
    only the key order of the message dict, which vLLM rebuilds anyway.  None: not such a message."""
    if type(m.get("content")) is not str or type(m.get("role")) is not str or not _PLAIN_KEYS.issuperset(m):
        return None
    name = m.get("name", "")
    if type(name) is not str:
        return None  # no member takes a non-string name: let the union say why
    if m["role"] in _NAMED_ROLES:
        return m
    if any(type(m.get(k)) not in (str, type(None)) for k in ("tool_call_id", "reasoning", "task")):
        return None
    return m


def validate_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Every message validated, then the lazily checked tool calls read (the request's validators)."""
    out = [validate_message(m, n) for n, m in enumerate(messages)]
    for n, m in enumerate(out):
        validate_tool_calls(m, n)
    return out


def validate_tool_calls(message: dict[str, Any], n: int) -> None:
    """The request's "after" validator reads lazily validated tool calls into a list (errors are 400s)."""
    calls = message.get("tool_calls")
    if isinstance(calls, LazyParts):
        message["tool_calls"] = materialize(calls, f"messages[{n}].tool_calls")


def materialize(lazy: LazyParts, where: str) -> list[Any]:
    """Validate lazily checked items now, as vLLM's iteration does."""
    out = []
    for i, item in enumerate(lazy.items):
        try:
            out.append(lazy.item.check(item)[0])
        except Invalid as e:
            raise RequestValidationError(f"{where}[{i}] is not valid: {e}") from None
    return out
