"""The unions' dispatch on tag values (``typed_dicts.OneOf.check``) against trying every member in order
(``OneOf.check_all``, the plain reading of pydantic's smart mode): the same output, the same member
winning, the same error, for messages and content parts of every shape vLLM's request declares."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenizer_cache import RequestValidationError
from tokenizer_cache.request_schema import _VLLM_PARTS, validate_message
from tokenizer_cache.typed_dicts import Invalid, LazyParts, OneOf

# Keys and tag values the schemas declare, plus some they do not: dispatch must not depend on either.
_KEYS = (
    "type", "text", "image_url", "uuid", "url", "image_pil", "image_embeds", "audio_url", "video_url",
    "input_audio", "data", "format", "file", "refusal", "name", "thinking", "closed", "detail",
    "prompt_cache_breakpoint", "mode", "cache_control", "role", "content", "tool_calls", "tool_call_id",
)  # fmt: skip
_TAGS = (
    "text", "image_url", "input_audio", "file", "audio_url", "video_url", "refusal", "image_embeds",
    "audio_embeds", "video_embeds", "prompt_embeds", "tool_reference", "thinking", "input_text",
    "explicit", "auto", "wav", "user", "assistant", "system", "tool", "developer", "function", "ipython",
)  # fmt: skip

_scalars = st.one_of(
    st.sampled_from(_TAGS), st.text(max_size=3), st.none(), st.booleans(), st.integers(-1, 2)
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(_KEYS), inner, max_size=4)
    ),
    max_leaves=8,
)
_fields = st.one_of(_values, st.text(max_size=3), st.fixed_dictionaries({"url": st.text(max_size=3)}))
# Parts with a tag most of the time (members are told apart by it), any keys around it.
_parts = st.one_of(
    st.dictionaries(st.sampled_from(_KEYS), _values, max_size=5),
    st.fixed_dictionaries(
        {"type": st.sampled_from(_TAGS)},
        optional={k: _fields for k in _KEYS if k != "type"},
    ),
)
_messages = st.fixed_dictionaries(
    {"role": st.sampled_from(_TAGS)},
    optional={
        "content": st.one_of(st.text(max_size=3), st.lists(_parts, max_size=3)),
        "name": _values,
        "tool_calls": _values,
    },
)


@contextmanager
def _undispatched() -> Iterator[None]:
    """Every union tries every member in order, as before the dispatch."""
    saved = OneOf.check
    OneOf.check = OneOf.check_all  # type: ignore[method-assign]
    try:
        yield
    finally:
        OneOf.check = saved  # type: ignore[method-assign]


def _outcome(fn: Any, value: Any) -> tuple[str, Any]:
    try:
        out = fn(value)
    except (Invalid, RequestValidationError) as e:
        return "error", str(e)
    return "ok", _plain(out)


def _plain(v: Any) -> Any:
    """Outputs compared with their key order (which the templates see) and lazy parts unwrapped."""
    if isinstance(v, LazyParts):
        return ("lazy", _plain(v.items), id(v.item))
    if isinstance(v, dict):
        return [(k, _plain(x)) for k, x in v.items()]
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


@given(_parts)
def test_a_part_validates_as_trying_every_member_does(part: dict[str, Any]) -> None:
    fast = _outcome(_VLLM_PARTS.check, part)
    with _undispatched():
        slow = _outcome(_VLLM_PARTS.check, part)
    assert fast == slow


@given(_messages)
def test_a_message_validates_as_trying_every_member_does(message: dict[str, Any]) -> None:
    fast = _outcome(lambda m: validate_message(m, 0), message)
    with _undispatched():
        slow = _outcome(lambda m: validate_message(m, 0), message)
    assert fast == slow


@pytest.mark.parametrize(
    ("part", "winner_keys"),
    [
        # the declared image part loses to the simple one when its URL object is null: 2 fields set
        ({"type": "image_url", "image_url": None, "uuid": "a"}, ["image_url", "uuid", "type"]),
        ({"type": "image_url", "image_url": {"url": "u"}}, ["image_url", "type"]),
        ({"text": "t", "type": "text"}, ["text", "type"]),
        ({"type": "text", "text": "t", "x": 1}, ["text", "type", "x"]),
    ],
)
def test_known_parts_keep_vllms_key_order(part: dict[str, Any], winner_keys: list[str]) -> None:
    out, _ = _VLLM_PARTS.check(part)
    assert list(out) == winner_keys


@pytest.mark.parametrize("part", [3, None, [], True])
def test_a_part_no_member_takes_names_every_members_reason(part: Any) -> None:
    with pytest.raises(Invalid) as fast:
        _VLLM_PARTS.check(part)
    with _undispatched(), pytest.raises(Invalid) as slow:
        _VLLM_PARTS.check(part)
    assert str(fast.value) == str(slow.value)
    assert "TextPart" in str(fast.value)  # a member the tag rules out still gives its reason


# The shapes ``request_schema._common_part`` answers, and each one step away from them (a key added,
# dropped or given another value), in any key order.
_s3 = st.text(max_size=3)
_common = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": _s3}),
    st.fixed_dictionaries(
        {"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": _s3})},
        optional={"uuid": _s3},
    ),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.none(), "uuid": _s3}),
)


@st.composite
def _near_common(draw: st.DrawFn) -> dict[str, Any]:
    part = dict(draw(_common))
    step = draw(st.sampled_from(("none", "add", "drop", "change", "change_url")))
    if step == "add":
        part[draw(st.sampled_from(_KEYS))] = draw(_fields)
    elif step == "drop":
        del part[draw(st.sampled_from(sorted(part)))]
    elif step == "change":
        part[draw(st.sampled_from(sorted(part)))] = draw(_fields)
    elif step == "change_url" and isinstance(part.get("image_url"), dict):
        part["image_url"] = {**part["image_url"], draw(st.sampled_from(("url", "detail"))): draw(_fields)}
    return dict(draw(st.permutations(list(part.items()))))


@given(_near_common())
def test_common_parts_decided_without_the_union_as_the_union_decides(part: dict[str, Any]) -> None:
    assert _outcome(_VLLM_PARTS.check, part) == _outcome(_VLLM_PARTS.check_all, part)


@pytest.mark.parametrize(
    "part",
    [
        {"type": "text", "text": "t"},
        {"uuid": "a", "type": "image_url", "image_url": None},
        {"image_url": {"url": "u"}, "type": "image_url"},
        {"type": "image_url", "uuid": "a", "image_url": {"url": "u"}},
    ],
)
def test_the_common_shapes_take_the_shortcut(part: dict[str, Any]) -> None:
    assert _VLLM_PARTS.common is not None
    got = _VLLM_PARTS.common(part)
    assert got is not None and _plain(got) == _plain(_VLLM_PARTS.check_all(part))
