"""The shape checks vLLM's request model applies to chat messages, reproduced without pydantic.

vLLM 0.33 validates ``messages`` against a union of TypedDicts (OpenAI's six message types, then vLLM's own
catch-all message type) inside a model that allows extra keys.  Which member wins decides what reaches the
template and which requests are refused, so it is reproduced here:

- each member is tried; a member validates when its required keys are present and every declared key
  it finds has the declared type (extra keys are kept, after the declared ones);
- the winner is the member that *sets the most declared fields*, counting the fields of nested TypedDicts
  validated eagerly (content parts in a ``list``, tool calls in a ``list``); ties go to the earlier member;
- OpenAI's members declare their content parts and tool calls as ``Iterable``: validated lazily, when
  vLLM iterates them, so a part those members do not know fails the request there (a 400) even though
  vLLM's own member would have accepted it.  Such content is returned as ``LazyParts``.

So ``{"role": "user", "content": [{"type": "text", ...}]}`` goes to vLLM's member (4 fields set against 2),
while ``[{"type": "input_text", ...}]`` alone goes to OpenAI's user member (2 against 2) and fails.

Validated dicts keep vLLM's key order (declared keys in declaration order, then extras in input order):
templates that serialise a tool call or a content part see them in that order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import RequestValidationError

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


class Invalid(Exception):
    """A value does not fit a schema (internal; turned into ``RequestValidationError``)."""


# -- schema nodes: (validate(value) -> (output, fields_set_count or None)) ---------------------------


class _Node:
    def check(self, value: Any) -> tuple[Any, int | None]:
        raise NotImplementedError


class _Str(_Node):
    def check(self, value: Any) -> tuple[Any, int | None]:
        if type(value) is not str:
            raise Invalid("a string")
        return value, None


class _Bool(_Node):
    """pydantic's lax bool: booleans, 0/1, and the usual words."""

    _WORDS = {"1": True, "on": True, "t": True, "true": True, "y": True, "yes": True}
    _WORDS.update({"0": False, "off": False, "f": False, "false": False, "n": False, "no": False})

    def check(self, value: Any) -> tuple[Any, int | None]:
        return lax_bool(value), None


class _Any(_Node):
    def check(self, value: Any) -> tuple[Any, int | None]:
        return value, None


class _None(_Node):
    def check(self, value: Any) -> tuple[Any, int | None]:
        if value is not None:
            raise Invalid("null")
        return None, None


@dataclass(frozen=True)
class _Lit(_Node):
    values: tuple[str, ...]

    def check(self, value: Any) -> tuple[Any, int | None]:
        if type(value) is not str or value not in self.values:
            raise Invalid(f"one of {list(self.values)}")
        return value, None


@dataclass(frozen=True)
class _Dict(_Node):
    """``dict[str, X]``."""

    value: _Node

    def check(self, value: Any) -> tuple[Any, int | None]:
        if not isinstance(value, Mapping):
            raise Invalid("an object")
        out = {}
        for k, v in value.items():
            if type(k) is not str:
                raise Invalid("string keys")
            out[k] = self.value.check(v)[0]
        return out, None


@dataclass(frozen=True)
class _List(_Node):
    item: _Node

    def check(self, value: Any) -> tuple[Any, int | None]:
        if type(value) is not list:
            raise Invalid("an array")
        out, total = [], None
        for v in value:
            o, n = self.item.check(v)
            out.append(o)
            if n is not None:
                total = (total or 0) + n
        return out, total


@dataclass
class LazyParts:
    """Content kept as given, validated item by item (against ``item``) only when vLLM reads it."""

    items: list[Any]
    item: _Node


@dataclass(frozen=True)
class _Iterable(_Node):
    item: _Node

    def check(self, value: Any) -> tuple[Any, int | None]:
        if isinstance(value, (list, tuple)):
            return LazyParts(list(value), self.item), None
        if isinstance(value, (str, Mapping)):  # iterable in Python: characters, keys
            return LazyParts(list(value), self.item), None
        raise Invalid("an iterable")


@dataclass(frozen=True)
class _Union(_Node):
    choices: tuple[_Node, ...]

    def check(self, value: Any) -> tuple[Any, int | None]:
        best: tuple[Any, int | None] | None = None
        reasons: list[Any] = []
        for choice in self.choices:
            if isinstance(choice, _TD):
                if (why := choice.rejects(value)) is not None:
                    reasons.append(why)  # a cheap first look: not an object, or a tag that differs
                    continue
                if (
                    best is not None
                    and best[1] is not None
                    and choice.flat
                    and best[1] >= choice.bound(value)
                ):
                    continue  # it cannot set more fields than the best so far, and ties go to the earlier

            try:
                out, n = choice.check(value)
            except Invalid as e:
                reasons.append(e)
                continue
            if n is None and best is None:
                return out, n  # an exact match that sets no fields wins at once
            if best is None or (best[1] is not None and n is not None and n > best[1]):
                best = (out, n)
        if best is None:
            raise Invalid(" or ".join(dict.fromkeys(map(str, reasons))))
        return best


def _nests(node: _Node) -> bool:
    if isinstance(node, _TD):
        return True
    if isinstance(node, _Union):
        return any(_nests(c) for c in node.choices)
    if isinstance(node, (_List, _Dict)):
        return _nests(node.item if isinstance(node, _List) else node.value)
    return False


def _is_object(value: Any) -> bool:
    return type(value) is dict or isinstance(value, Mapping)


class _TD(_Node):
    """A TypedDict in a model that allows extra keys."""

    def __init__(self, name: str, fields: tuple[tuple[str, _Node, bool], ...]) -> None:
        self.name = name
        self.fields = fields
        self.declared = frozenset(f[0] for f in fields)
        # Required literal fields ("role", "type"): checked first, without building anything.
        self.tags = tuple((k, n.values) for k, n, req in fields if req and isinstance(n, _Lit))
        # No nested TypedDict: the fields it sets are at most the declared keys present.
        self.flat = not any(_nests(n) for _, n, _ in fields)

    def bound(self, value: Mapping[str, Any]) -> int:
        return sum(1 for k in self.declared if k in value)

    def rejects(self, value: Any) -> str | None:
        """Why ``value`` cannot be this type, found cheaply (None: it may be)."""
        if not _is_object(value):
            return f"an object ({self.name})"
        for key, values in self.tags:
            tag = value.get(key)
            if type(tag) is not str or tag not in values:
                return f"{self.name}.{key} in {list(values)}"
        return None

    def check(self, value: Any) -> tuple[Any, int | None]:
        if not _is_object(value):
            raise Invalid(f"an object ({self.name})")
        out: dict[str, Any] = {}
        count = 0
        for key, node, required in self.fields:
            if key in value:
                try:
                    out[key], nested = node.check(value[key])
                except Invalid as e:
                    raise Invalid(f"{self.name}.{key}: {e}") from None
                count += 1 + (nested or 0)
            elif required:
                raise Invalid(f"{self.name}.{key} is required")
        declared = self.declared
        for k, v in value.items():
            if k not in declared:
                out[k] = v
        return out, count


class _ByRole(_Node):
    """The message union: the OpenAI member whose ``role`` literal matches (at most one does), then vLLM's
    catch-all member, in that order; the other members fail on their role, so they are not tried."""

    def __init__(self, openai: tuple[_TD, ...], custom: _TD) -> None:
        self.by_role = {
            v: _Union((td, custom)) for td in openai for k, vals in td.tags if k == "role" for v in vals
        }
        self.custom_only = _Union((custom,))

    def check(self, value: Any) -> tuple[Any, int | None]:
        role = value.get("role") if _is_object(value) else None
        return (
            self.by_role.get(role, self.custom_only).check(value)
            if type(role) is str
            else self.custom_only.check(value)
        )


def _opt(node: _Node) -> _Node:
    return _Union((node, _None()))


def lax_bool(value: Any) -> bool:
    if type(value) is bool:
        return value
    if type(value) in (int, float) and value in (0, 1):
        return bool(value)
    if type(value) is str and value.strip().lower() in _Bool._WORDS:
        return _Bool._WORDS[value.strip().lower()]
    raise Invalid("a boolean")


def lax_int(value: Any) -> int:
    """pydantic's lax int: integers (and booleans), integral floats, numeric strings."""
    if type(value) in (int, bool):
        return int(value)
    if type(value) is float and value.is_integer():
        return int(value)
    if type(value) is str:
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise Invalid("an integer")


# -- the schemas (openai 3.x types and vLLM 0.33's additions) --------------------------------------

_S, _B, _ANY = _Str(), _Bool(), _Any()
_EMBEDS = _opt(_Union((_S, _Dict(_ANY))))
_BREAKPOINT = _TD(
    "PromptCacheBreakpoint", (("mode", _Lit(("explicit",)), True), ("ttl", _Lit(("30m", "12h")), False))
)
_TEXT = _TD(
    "TextPart",
    (("text", _S, True), ("type", _Lit(("text",)), True), ("prompt_cache_breakpoint", _BREAKPOINT, False)),
)
_IMAGE = _TD(
    "ImagePart",
    (
        (
            "image_url",
            _TD(
                "ImageURL", (("url", _S, True), ("detail", _Lit(("auto", "low", "high", "original")), False))
            ),
            True,
        ),
        ("type", _Lit(("image_url",)), True),
        ("prompt_cache_breakpoint", _BREAKPOINT, False),
    ),
)
_INPUT_AUDIO = _TD(
    "InputAudioPart",
    (
        (
            "input_audio",
            _TD("InputAudio", (("data", _S, True), ("format", _Lit(("wav", "mp3")), True))),
            True,
        ),
        ("type", _Lit(("input_audio",)), True),
        ("prompt_cache_breakpoint", _BREAKPOINT, False),
    ),
)
_FILE = _TD(
    "File",
    (
        (
            "file",
            _TD("FileFile", (("file_data", _S, False), ("file_id", _S, False), ("filename", _S, False))),
            True,
        ),
        ("type", _Lit(("file",)), True),
        ("prompt_cache_breakpoint", _BREAKPOINT, False),
    ),
)
_REFUSAL = _TD("RefusalPart", (("refusal", _S, True), ("type", _Lit(("refusal",)), True)))
_URL = _TD("URL", (("url", _S, True),))
_VLLM_PARTS = _Union(
    (
        _TEXT,
        _IMAGE,
        _INPUT_AUDIO,
        _FILE,
        _TD("AudioPart", (("audio_url", _URL, True), ("type", _Lit(("audio_url",)), True))),
        _TD("VideoPart", (("video_url", _URL, True), ("type", _Lit(("video_url",)), True))),
        _REFUSAL,
        _TD("PILImagePart", (("image_pil", _opt(_ANY), False), ("uuid", _opt(_S), False))),
        _TD("SimpleImagePart", (("image_url", _opt(_S), False), ("uuid", _opt(_S), False))),
        _TD(
            "ImageEmbedsPart",
            (
                ("image_embeds", _EMBEDS, False),
                ("type", _Lit(("image_embeds",)), True),
                ("uuid", _opt(_S), False),
            ),
        ),
        _TD(
            "AudioEmbedsPart",
            (
                ("audio_embeds", _EMBEDS, False),
                ("type", _Lit(("audio_embeds",)), True),
                ("uuid", _opt(_S), False),
            ),
        ),
        _TD(
            "VideoEmbedsPart",
            (
                ("video_embeds", _EMBEDS, False),
                ("audio_embeds", _EMBEDS, False),
                ("type", _Lit(("video_embeds",)), True),
                ("uuid", _opt(_S), False),
            ),
        ),
        _TD("PromptEmbedsPart", (("data", _S, True), ("type", _Lit(("prompt_embeds",)), True))),
        _TD("SimpleAudioPart", (("audio_url", _opt(_S), False),)),
        _TD("SimpleVideoPart", (("video_url", _opt(_S), False), ("uuid", _opt(_S), False))),
        _TD("ToolReferencePart", (("name", _S, False), ("type", _Lit(("tool_reference",)), False))),
        _S,
        _TD(
            "ThinkingPart",
            (("thinking", _S, True), ("closed", _B, False), ("type", _Lit(("thinking",)), True)),
        ),
    )
)
_FUNCTION = _TD("Function", (("arguments", _S, True), ("name", _S, True)))
_FUNCTION_CALL = _TD(
    "FunctionToolCall", (("id", _S, True), ("function", _FUNCTION, True), ("type", _Lit(("function",)), True))
)
_CUSTOM_CALL = _TD(
    "CustomToolCall",
    (
        ("id", _S, True),
        ("custom", _TD("Custom", (("input", _S, True), ("name", _S, True))), True),
        ("type", _Lit(("custom",)), True),
    ),
)
_FUNCTION_DEF = _TD(
    "FunctionDefinition",
    (
        ("name", _S, True),
        ("description", _S, False),
        ("parameters", _Dict(_ANY), False),
        ("strict", _opt(_B), False),
    ),
)


def _text_only_content(required: bool = True) -> tuple[str, _Node, bool]:
    return ("content", _Union((_S, _Iterable(_TEXT))), required)


_OPENAI_MESSAGES = (
    _TD(
        "DeveloperMessage",
        (_text_only_content(), ("role", _Lit(("developer",)), True), ("name", _S, False)),
    ),
    _TD("SystemMessage", (_text_only_content(), ("role", _Lit(("system",)), True), ("name", _S, False))),
    _TD(
        "UserMessage",
        (
            ("content", _Union((_S, _Iterable(_Union((_TEXT, _IMAGE, _INPUT_AUDIO, _FILE))))), True),
            ("role", _Lit(("user",)), True),
            ("name", _S, False),
        ),
    ),
    _TD(
        "AssistantMessage",
        (
            ("role", _Lit(("assistant",)), True),
            ("audio", _opt(_TD("Audio", (("id", _S, True),))), False),
            ("content", _Union((_S, _Iterable(_Union((_TEXT, _REFUSAL))), _None())), False),
            (
                "function_call",
                _opt(_TD("FunctionCall", (("arguments", _S, True), ("name", _S, True)))),
                False,
            ),
            ("name", _S, False),
            ("refusal", _opt(_S), False),
            ("tool_calls", _Iterable(_Union((_FUNCTION_CALL, _CUSTOM_CALL))), False),
        ),
    ),
    _TD("ToolMessage", (_text_only_content(), ("role", _Lit(("tool",)), True), ("tool_call_id", _S, True))),
    _TD(
        "FunctionMessage",
        (("content", _opt(_S), True), ("name", _S, True), ("role", _Lit(("function",)), True)),
    ),
)
_CUSTOM_MESSAGE = _TD(
    "CustomMessage",
    (
        ("role", _S, True),
        ("content", _Union((_S, _List(_VLLM_PARTS))), False),
        ("name", _S, False),
        ("tool_call_id", _opt(_S), False),
        ("tool_calls", _opt(_List(_FUNCTION_CALL)), False),
        (
            "reasoning",
            _Union(
                (
                    _S,
                    _TD(
                        "PromptEmbedsPart",
                        (("data", _S, True), ("type", _Lit(("prompt_embeds",)), True)),
                    ),
                    _None(),
                )
            ),
            False,
        ),
        (
            "tools",
            _opt(
                _List(
                    _TD(
                        "FunctionTool",
                        (("function", _FUNCTION_DEF, True), ("type", _Lit(("function",)), True)),
                    )
                )
            ),
            False,
        ),
        ("task", _opt(_S), False),
    ),
)
_MESSAGES = _ByRole(_OPENAI_MESSAGES, _CUSTOM_MESSAGE)


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
