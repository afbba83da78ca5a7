"""Rendering a chat request into prompt text the way vLLM does (text-only messages).

vLLM's chat path, which this mirrors step by step (``vllm/entrypoints/chat_utils.py`` and the OpenAI
serving layer):

1. Messages are rebuilt, keeping only what the template may see: ``role``; ``content`` (``None`` -> no
   parts, a string -> one text part; text parts ``text``/``input_text``/``output_text`` give their
   ``text``, ``refusal`` its ``refusal``, ``thinking`` its ``thinking``); an assistant's ``tool_calls``
   and ``reasoning`` (also copied to ``reasoning_content``); a tool message's ``tool_call_id``; a string
   ``name``.  With the "string" content format the text parts are joined with newlines; with the
   "openai" format (templates that loop over ``message.content``) they stay ``{"type": "text", ...}``
   parts.  "auto" detects the format from the template's syntax tree.
2. Tool-call ``arguments`` given as JSON strings are parsed into objects (empty -> ``{}``).
3. Tools are dumped like vLLM's pydantic model: ``{"type", "function": {"name", "description",
   "parameters", ...extra}, ...extra}`` with absent description/parameters as ``None``.
4. Template arguments: ``add_generation_prompt``, ``continue_final_message`` and ``documents``, then
   the request's ``chat_template_kwargs`` on top (they may override those).  ``tokenize`` there is an
   error; ``chat_template`` / ``tools`` there replace the request's.  Other keys reach the template only
   if it (or ``apply_chat_template``) names them; the rest are dropped silently, as vLLM does.
5. ``tokenizer.apply_chat_template(conversation, tools=..., chat_template=..., tokenize=False, ...)``.
   The text is then tokenized without adding special tokens (the template wrote them).

Media parts (images, audio, video) are refused with ``UnsupportedContentError``: vLLM would insert
model-specific placeholders that a router cannot reproduce.
"""

from __future__ import annotations

import inspect
import json
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox

from .errors import ChatTemplateError, NoChatTemplateError
from .loading import HFTokenizer

__all__ = [
    "ChatRenderer",
    "ContentFormat",
    "UnsupportedContentError",
    "detect_content_format",
    "normalize_messages",
    "normalize_tools",
]

ContentFormat = Literal["auto", "string", "openai"]

_TEXT_PARTS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
# apply_chat_template parameters that shape its return value, not the rendered text: never forwarded.
_OUTPUT_ONLY = frozenset(
    {
        "tokenize",
        "chat_template",
        "return_dict",
        "return_tensors",
        "padding",
        "truncation",
        "max_length",
        "tokenizer_kwargs",
        "return_assistant_tokens_mask",
        "conversation",
    }
)


class UnsupportedContentError(ChatTemplateError):
    """A message has media content; the gateway may route such a request without token ids."""


def _text_of(part: Any) -> str | None:
    if isinstance(part, str):
        return part
    if not isinstance(part, Mapping):
        raise ChatTemplateError(f"a content part must be a string or an object, got {type(part).__name__}")
    typ = part.get("type")
    if typ in _TEXT_PARTS:
        text = part.get(_TEXT_PARTS[typ])
        if text is not None and not isinstance(text, str):
            raise ChatTemplateError(f"content part {typ!r} must hold a string")
        return text
    if typ is None and not any(k.endswith(("_url", "_embeds", "_pil", "_audio")) for k in part):
        raise ChatTemplateError("a content part has no 'type'")
    raise UnsupportedContentError(f"content parts of type {typ!r} are not supported by the router tokenizer")


def normalize_messages(
    messages: Sequence[Mapping[str, Any]], content_format: Literal["string", "openai"]
) -> list[dict[str, Any]]:
    """Rebuild request messages as vLLM hands them to the chat template (steps 1 and 2)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError("messages must be a list of message objects")
    out: list[dict[str, Any]] = []
    for n, msg in enumerate(messages):
        if not isinstance(msg, Mapping) or not isinstance(msg.get("role"), str):
            raise ChatTemplateError(f"message {n} must be an object with a string 'role'")
        role = msg["role"]
        content = msg.get("content")
        parts: list[Any] = [content] if isinstance(content, str) else list(content or [])
        texts = [t for t in map(_text_of, parts) if t is not None]
        new: dict[str, Any] = {"role": role}
        if content_format == "openai":
            new["content"] = [{"type": "text", "text": t} for t in texts]
        else:
            new["content"] = "\n".join(texts)
        if role == "assistant":
            if msg.get("tool_calls") is not None:
                new["tool_calls"] = [_parse_tool_call(c, n) for c in msg["tool_calls"]]
            reasoning = msg.get("reasoning") or msg.get("reasoning_content")
            if reasoning is not None:
                new["reasoning"] = reasoning
                new["reasoning_content"] = reasoning
        elif role == "tool" and "tool_call_id" in msg:
            new["tool_call_id"] = msg["tool_call_id"]
        if isinstance(msg.get("name"), str):
            new["name"] = msg["name"]
        out.append(new)
    return out


def _parse_tool_call(call: Any, n: int) -> dict[str, Any]:
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        raise ChatTemplateError(f"message {n}: each tool call needs a 'function' object")
    fn = dict(call["function"])
    args = fn.get("arguments")
    if not args:
        fn["arguments"] = {}
    elif not isinstance(args, (dict, list)):
        try:
            fn["arguments"] = json.loads(args)
        except (TypeError, ValueError) as e:
            raise ChatTemplateError(f"message {n}: tool call arguments are not valid JSON: {e}") from e
    return {**call, "function": fn}


def normalize_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Tool definitions as vLLM's ``ChatCompletionToolsParam.model_dump()`` gives them (step 3)."""
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)):
        raise ChatTemplateError("tools must be a list of tool objects")
    out = []
    for t in tools:
        if not isinstance(t, Mapping) or not isinstance(t.get("function"), Mapping):
            raise ChatTemplateError("each tool must be an object with a 'function' object")
        fn = t["function"]
        if not isinstance(fn.get("name"), str):
            raise ChatTemplateError("each tool function needs a string 'name'")
        dumped_fn = {
            "name": fn["name"],
            "description": fn.get("description"),
            "parameters": fn.get("parameters"),
        }
        dumped_fn.update((k, v) for k, v in fn.items() if k not in dumped_fn)
        dumped = {"type": t.get("type", "function"), "function": dumped_fn}
        dumped.update((k, v) for k, v in t.items() if k not in dumped)
        out.append(dumped)
    return out


# -- template analysis ---------------------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """Parses transformers' ``{% generation %}`` blocks (this environment only analyses templates)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _parse(template: str) -> jinja2.nodes.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag]
    )
    try:
        return env.parse(template)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template does not parse: {e}") from e


def _refers(node: jinja2.nodes.Node, names: set[str], key: str | None = None) -> bool:
    """Is ``node`` one of ``names`` (or ``name.key`` / ``name[key]``), possibly filtered or sliced?"""
    if isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)):
        return node.node is not None and _refers(node.node, names, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _refers(node.node, names, key)
    if key is None:
        return isinstance(node, jinja2.nodes.Name) and node.name in names
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == key and _refers(node.node, names)
    if isinstance(node, jinja2.nodes.Getitem):
        arg = node.arg
        return isinstance(arg, jinja2.nodes.Const) and arg.value == key and _refers(node.node, names)
    return False


def detect_content_format(template: str) -> Literal["string", "openai"]:
    """ "openai" if the template loops over a message's ``content`` (like vLLM's detection), else "string"."""
    ast = _parse(template)
    lists = {"messages"}
    grew = True
    while grew:  # names assigned from messages (or slices/filters of it)
        grew = False
        for a in ast.find_all(jinja2.nodes.Assign):
            if (
                isinstance(a.target, jinja2.nodes.Name)
                and a.target.name not in lists
                and _refers(a.node, lists)
            ):
                lists.add(a.target.name)
                grew = True
    loops = list(ast.find_all(jinja2.nodes.For))
    items = {
        f.target.name for f in loops if isinstance(f.target, jinja2.nodes.Name) and _refers(f.iter, lists)
    }
    if any(_refers(f.iter, items, "content") for f in loops):
        return "openai"
    return "string"


class ChatRenderer:
    """Renders chat requests with one tokenizer (steps 1-5); safe to share between threads."""

    def __init__(
        self, tok: HFTokenizer, *, chat_template: str | None = None, content_format: ContentFormat = "auto"
    ) -> None:
        self._tok = tok
        self._template = chat_template
        self._content_format = content_format
        params = inspect.signature(tok.apply_chat_template).parameters.values()
        self._named = frozenset(p.name for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD)
        self._lock = threading.Lock()
        self._analysis: dict[str, tuple[frozenset[str], Literal["string", "openai"]]] = {}

    def _analyse(self, template: str) -> tuple[frozenset[str], Literal["string", "openai"]]:
        with self._lock:
            hit = self._analysis.get(template)
        if hit is None:
            variables = frozenset(jinja2.meta.find_undeclared_variables(_parse(template)))
            hit = (variables, detect_content_format(template))
            with self._lock:
                if len(self._analysis) > 64:
                    self._analysis.clear()
                self._analysis[template] = hit
        return hit

    def _resolve_template(self, template: str | None, tools: list[dict[str, Any]] | None) -> str:
        if template is not None:
            return template
        if self._template is not None:
            return self._template
        try:
            resolved = self._tok.get_chat_template(None, tools=tools)
        except Exception as e:  # transformers raises ValueError when the tokenizer has none
            raise NoChatTemplateError(
                "the tokenizer has no chat template; configure one (chat_template=... or the fleet "
                f"file's chat_template) or pass one with the request: {e}"
            ) from e
        if not isinstance(resolved, str):
            raise NoChatTemplateError("the tokenizer has no usable chat template")
        return resolved

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        if add_generation_prompt and continue_final_message:
            raise ChatTemplateError("cannot set both continue_final_message and add_generation_prompt")
        merged: dict[str, Any] = {
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
        }
        if documents is not None:
            if not isinstance(documents, (list, tuple)):
                raise ChatTemplateError("documents must be a list of objects")
            merged["documents"] = list(documents)
        if chat_template_kwargs:
            if not isinstance(chat_template_kwargs, Mapping):
                raise ChatTemplateError("chat_template_kwargs must be an object")
            if "tokenize" in chat_template_kwargs:
                raise ChatTemplateError("chat_template_kwargs must not contain 'tokenize'")
            merged.update(chat_template_kwargs)
        template = merged.pop("chat_template", None) or chat_template
        if template is not None and not isinstance(template, str):
            raise ChatTemplateError("chat_template must be a string")
        tool_dicts = normalize_tools(merged.pop("tools", tools))
        template = self._resolve_template(template, tool_dicts)
        variables, detected = self._analyse(template)
        fmt = detected if self._content_format == "auto" else self._content_format
        kwargs = {
            k: v for k, v in merged.items() if (k in self._named or k in variables) and k not in _OUTPUT_ONLY
        }
        conversation = normalize_messages(messages, fmt)
        try:
            text = self._tok.apply_chat_template(
                conversation, tools=tool_dicts, chat_template=template, tokenize=False, **kwargs
            )
        except ChatTemplateError:
            raise
        except Exception as e:  # jinja2 errors, raise_exception() in templates, TypeError, KeyError...
            raise ChatTemplateError(f"chat template error: {type(e).__name__}: {e}") from e
        if not isinstance(text, str):
            raise ChatTemplateError("the chat template did not render to text")
        return text
