"""Chat messages turned into what the template sees, step for step as vLLM 0.33 does it.

Input: messages as ``request_schema.validate_message`` leaves them.  For each message (``conversation``):
its content becomes parts (billing-header lines dropped from system messages), each part is read by its
type (media parts go to the ``MediaSink`` when the model's processor is reproduced, else raise
``UnsupportedContentError``), the parts are joined ("string" format) or kept as typed parts ("openai"),
and the message is rebuilt in vLLM's key order.

Then over the conversation (``postprocess``): empty ``tool_calls`` dropped, each tool call checked, and
its ``arguments`` parsed into an object (anything that is not an object after that becomes ``{}``); the
argument dicts are the request's own, as vLLM edits them in place.  Before rendering
(``developer_to_system``): developer messages become system messages when the template never names the
developer role, and system messages are then merged into one first message when needed.

Every rule, with its source: docs/parity.md, sections 4 and 5.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

from .errors import ChatTemplateError, RequestValidationError, UnsupportedContentError
from .mm.items import MediaRef
from .request_schema import LazyParts, materialize

__all__ = ["MediaSink", "UnsupportedContentError", "conversation", "developer_to_system", "postprocess"]

ContentFormatName = Literal["string", "openai"]

_TEXT_FIELD = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
_MEDIA_TYPES = frozenset(
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
# Keys a part without "type" (or with a "uuid") is recognised by, in vLLM's order.
_MEDIA_KEYS = (
    "image_url",
    "image_pil",
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "prompt_embeds",
    "audio_url",
    "input_audio",
    "video_url",
)
_MEDIA_KEY_SET = frozenset(_MEDIA_KEYS)
# Every key some content part type declares: the others travel with a text part in the "openai" format.
_KNOWN_PART_KEYS = frozenset(
    {
        "audio_embeds",
        "audio_url",
        "closed",
        "data",
        "file",
        "image_embeds",
        "image_pil",
        "image_url",
        "input_audio",
        "name",
        "prompt_cache_breakpoint",
        "refusal",
        "text",
        "thinking",
        "type",
        "uuid",
        "video_embeds",
        "video_url",
    }
)
_BILLING_HEADER = "x-anthropic-billing-header"


def _strip_billing_header(parts: list[Any]) -> list[Any]:
    out = []
    for part in parts:
        text = (
            part
            if isinstance(part, str)
            else part.get("text")
            if isinstance(part, dict) and part.get("type") == "text"
            else None
        )
        if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


class MediaSink:
    """Where media parts go when the model's processor is reproduced (``tokenizer_cache.mm``): each part's
    ``MediaRef`` in prompt order, and the placeholder text a "string"-format message gets for it."""

    def __init__(self, placeholders: Mapping[str, str]) -> None:
        self.placeholders = placeholders
        self.refs: list[MediaRef] = []
        self.pending: list[str] = []
        """Placeholders of the message being converted ("string" format: they go before its text)."""

    def add(self, modality: str, url: Any, uuid: Any, where: str) -> str:
        if modality not in self.placeholders:
            raise UnsupportedContentError(f"{where}: {modality} items are not reproduced for this model")
        if url is not None and not isinstance(url, str):
            raise RequestValidationError(f"{where}: the media URL must be a string")
        name = uuid if uuid is None or type(uuid) is str else str(uuid)
        self.refs.append(MediaRef(modality, url or None, name))  # type: ignore[arg-type]
        return self.placeholders[modality]


def _media(part: dict[str, Any], kind: str | None, openai: bool, where: str, sink: MediaSink | None) -> Any:
    """A media part: ``{"type": <modality>, <undeclared keys>}`` ("openai") or None with its placeholder
    queued ("string"); ``UnsupportedContentError`` without a sink or for media not reproduced."""
    got = _media_kind(part, kind)
    if sink is None or got is None:
        raise UnsupportedContentError(f"{where}: media content is not supported by the router tokenizer")
    modality, url = got
    placeholder = sink.add(modality, url, part.get("uuid"), where)
    if openai:
        out = {"type": modality}
        if not part.keys() <= _KNOWN_PART_KEYS:  # undeclared keys ride along, in the part's order
            out.update((k, v) for k, v in part.items() if k not in _KNOWN_PART_KEYS)
        return out
    sink.pending.append(placeholder)
    return None


def _media_kind(part: dict[str, Any], kind: str | None) -> tuple[str, Any] | None:
    """(modality, URL) of a part vLLM reads as an image, audio or video URL; None for other media."""
    if kind is not None and part.get("uuid") is None:
        if kind == "image_url":
            v = part.get("image_url")
            return "image", v.get("url") if isinstance(v, dict) else None
        if kind == "input_image":
            return "image", part.get("image_url")
        if kind in ("audio_url", "video_url"):
            v = part.get(kind)
            return kind[:5], v.get("url") if isinstance(v, dict) else None
        return None
    for key, modality in (("image_url", "image"), ("audio_url", "audio"), ("video_url", "video")):
        if key in part:
            v = part[key]
            return modality, v.get("url") if isinstance(v, dict) else v
    return None


def _part(part: Any, openai: bool, where: str, sink: MediaSink | None = None) -> Any:
    """One content part as text (a string, a dict in the "openai" format) or None (skipped)."""
    if isinstance(part, str):
        return {"type": "text", "text": part} if openai else part
    if not isinstance(part, dict):
        raise RequestValidationError(f"{where}: a content part must be an object or a string")
    kind = part.get("type")
    if part.get("uuid") is not None or kind is None:
        if not _MEDIA_KEY_SET.isdisjoint(part):
            return _media(part, kind if isinstance(kind, str) else None, openai, where, sink)
        if "tool_reference" in part:
            return _tool_reference(part.get("name"), openai)
        raise RequestValidationError(f"{where}: Missing 'type' field in multimodal part.")
    if not isinstance(kind, str):
        raise RequestValidationError(f"{where}: Invalid 'type' field in multimodal part.")
    if kind in _TEXT_FIELD:
        text = part.get(_TEXT_FIELD[kind])
        if text is None and kind in ("text", "refusal"):
            return None
        if not openai:
            return text
        out = {"type": "text", "text": text}
        if not part.keys() <= _KNOWN_PART_KEYS:
            out.update((k, v) for k, v in part.items() if k not in _KNOWN_PART_KEYS)
        return out
    if kind == "tool_reference":
        return _tool_reference(part.get("name"), openai)
    if kind in _MEDIA_TYPES:
        return _media(part, kind, openai, where, sink)
    raise RequestValidationError(f"{where}: Unsupported chat content part type: {kind!r}.")


def _tool_reference(name: Any, openai: bool) -> Any:
    return {"type": "tool_reference", "name": name} if openai else name


def conversation(
    message: dict[str, Any], fmt: ContentFormatName, n: int, media: MediaSink | None = None
) -> dict[str, Any]:
    """One validated message as vLLM hands it to the template (steps 1-4 of the module doc)."""
    role = message["role"]
    reasoning = message.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("type") == "prompt_embeds":
        raise UnsupportedContentError(
            f"messages[{n}]: prompt_embeds reasoning is not supported by the router"
        )
    content = message.get("content")
    if isinstance(content, LazyParts):
        content = materialize(content, f"messages[{n}].content")
    parts: list[Any] = (
        []
        if content is None
        else [{"type": "text", "text": content}]
        if isinstance(content, str)
        else list(content)
    )
    if role == "system":
        parts = _strip_billing_header(parts)
    openai = fmt == "openai"
    # vLLM keeps only truthy parts: in the "string" format empty or missing texts vanish
    if media is not None:
        media.pending = []
    texts = [
        t for t in (_part(p, openai, f"messages[{n}].content[{i}]", media) for i, p in enumerate(parts)) if t
    ]
    if openai:
        out: dict[str, Any] = {"role": role, "content": texts}
    else:
        if any(not isinstance(t, str) for t in texts):
            raise ChatTemplateError(f"messages[{n}]: a text part is not a string")
        text = "\n".join(texts)
        if media is not None and media.pending:  # vLLM puts a message's placeholders before its text
            text = "\n".join([*media.pending, text]) if text else "\n".join(media.pending)
        out = {"role": role, "content": text}
    if role == "assistant":
        if message.get("tool_calls") is not None:
            out["tool_calls"] = list(message["tool_calls"])
        if reasoning is not None:
            out["reasoning"] = reasoning
            out["reasoning_content"] = reasoning
    elif role == "tool":
        if "tool_call_id" in message:
            out["tool_call_id"] = message["tool_call_id"]
        items = out["content"]
        if isinstance(items, list) and not any(
            isinstance(p, dict) and p.get("type") != "text" for p in items
        ):
            out["content"] = "\n".join(p.get("text", "") for p in items if isinstance(p, dict))
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    if isinstance(message.get("task"), str):
        out["task"] = message["task"]
    if role == "developer":
        out["tools"] = message.get("tools")
    return out


def postprocess(conv: list[dict[str, Any]]) -> None:
    """Tool calls: empty lists dropped, arguments parsed into objects (in place, see the module doc)."""
    for n, message in enumerate(conv):
        if message["role"] != "assistant" or "tool_calls" not in message:
            continue
        calls = message["tool_calls"]
        if not isinstance(calls, list):
            continue
        if not calls:
            del message["tool_calls"]
            continue
        for call in calls:
            if not isinstance(call, dict):
                raise RequestValidationError(f"messages[{n}]: assistant tool_calls entries must be objects.")
            function = call.get("function")
            if call.get("type", "function") != "function" or not isinstance(function, dict):
                raise RequestValidationError(
                    f"messages[{n}]: chat completions only support assistant tool_calls of type 'function'."
                )
            function["arguments"] = _arguments(function.get("arguments"))


def _arguments(raw: Any) -> Any:
    if not raw:
        return {}
    if isinstance(raw, dict):
        return raw
    parsed = raw
    if isinstance(raw, str):
        try:
            parsed = json.loads(raw)
        except ValueError:  # vLLM logs a warning and continues with {}
            parsed = None
    return parsed if isinstance(parsed, dict) else {}


def developer_to_system(conv: list[dict[str, Any]], template: str) -> list[dict[str, Any]]:
    """Developer messages for templates that do not know the role (see the module doc)."""
    if (
        not any(m["role"] == "developer" for m in conv)
        or '"developer"' in template
        or "'developer'" in template
    ):
        return conv
    converted = []
    for m in conv:
        if m["role"] == "developer":
            m = {k: v for k, v in m.items() if k != "tools"}
            m["role"] = "system"
        converted.append(m)
    texts: list[str] = []
    others = []
    merge = False
    for i, m in enumerate(converted):
        if m["role"] != "system":
            others.append(m)
            continue
        if i > 0 or texts:
            merge = True
        content = m.get("content", "")
        if isinstance(content, list):
            content = "\n".join(
                p["text"] if isinstance(p, Mapping) else p
                for p in content
                if (isinstance(p, Mapping) and "text" in p) or isinstance(p, str)
            )
        if content:
            texts.append(content)
    if not merge:
        return converted
    return [{"role": "system", "content": "\n\n".join(texts)}, *others]
