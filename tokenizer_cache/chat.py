"""Rendering a chat request into prompt text exactly as vLLM 0.33 does (text-only messages).

The steps, each in its own module: ``chat_request.plan_chat`` (the request body: field checks, tools,
``tool_choice``, trusted templates, reused decode ids, merged template arguments); ``request_schema``
(which message type each message validates as); ``messages`` (messages -> what the template sees);
``template`` (content format and variables of a template; rendering like transformers);
``ChatRenderer.render_plan`` here (template resolution and the arguments that reach it).

Template resolution (vLLM's ``resolve_chat_template``): the request's or the server's template, looked up
by name when the tokenizer has several; otherwise the tokenizer's own ("tool_use" when tools are given and
it has one, else "default").  Template arguments reach the template when they are parameters of
transformers' ``apply_chat_template`` or variables the template reads; the rest are dropped.  Arguments
that collide with transformers' own parameters or cannot be honoured without tokenizing are errors, as
in vLLM.  Every rule, with its source: docs/parity.md, section 5.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .anthropic_inputs import requires_system_first
from .chat_request import ChatPlan, plan_chat
from .config import RenderOptions
from .errors import ChatTemplateError, NoChatTemplateError
from .loading import HFTokenizer
from .messages import MediaSink, UnsupportedContentError, conversation, developer_to_system, postprocess
from .mm.items import MediaRef
from .responses_request import plan_responses
from .template import TemplateCache, detect_content_format

__all__ = [
    "ChatRenderer",
    "ContentFormat",
    "RenderedChat",
    "UnsupportedContentError",
    "detect_content_format",
]

ContentFormat = Literal["auto", "string", "openai"]

# transformers 5.16-5.20 ``apply_chat_template`` parameters (``self`` included: vLLM reads them off the
# unbound method).  vLLM forwards any of them; the template sees none of them as variables.
_APPLY_PARAMS = frozenset(
    {
        "self",
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_TOKENIZER_ARGS = ("padding", "truncation", "max_length", "return_tensors", "tokenizer_kwargs")


@dataclass(frozen=True)
class RenderedChat:
    """The template's output: ``text``, to be tokenized with the request's ``add_special_tokens``, unless
    ``pre_tokenized`` (``tokenize: true`` in the template arguments): then its tokens without specials."""

    text: str
    pre_tokenized: bool = False
    media: tuple[MediaRef, ...] = ()
    """The prompt's media items in order (their placeholders are in ``text``, to be expanded)."""


class ChatRenderer:
    """Renders chat requests with one tokenizer; safe to share between threads."""

    def __init__(
        self,
        tok: HFTokenizer,
        *,
        chat_template: str | None = None,
        content_format: ContentFormat | None = None,
        options: RenderOptions | None = None,
    ) -> None:
        self._tok = tok
        self._template = chat_template
        self.options = options = (options or RenderOptions()).validate()
        self._content_format = content_format or options.chat_template_content_format
        self._templates = TemplateCache()
        own = getattr(tok, "chat_template", None)
        self._own: str | dict[str, str] | None = own if isinstance(own, (str, dict)) else None
        self._specials = {k: str(v) for k in _SPECIAL_TOKENS if (v := getattr(tok, k, None)) is not None}
        self._merges_inline: bool | None = None
        """``merges_inline_system``, probed once: the templates it probes are fixed per renderer."""

    # -- whole requests ----------------------------------------------------------------------------

    def plan(self, body: Mapping[str, Any], assigned: Mapping[str, Any] | None = None) -> ChatPlan:
        """Read a chat request body (see ``chat_request``)."""
        return plan_chat(body, self.options, self._template, assigned)

    def plan_responses(
        self,
        body: Mapping[str, Any],
        *,
        previous_messages: Sequence[Mapping[str, Any]] | None = None,
        previous_output: Sequence[Mapping[str, Any]] | None = None,
    ) -> ChatPlan:
        """Read a Responses body (see ``responses_request``)."""
        return plan_responses(
            body,
            self.options,
            self._template,
            previous_messages=previous_messages,
            previous_output=previous_output,
        )

    def warm(self) -> None:
        """What a first request would compute, computed now (the default template compiled, the system
        message probe): a host does it once before it forks its workers, which then share it.  A model
        without a usable template is left as it is (its requests get the error)."""
        self.merges_inline_system()
        with contextlib.suppress(ChatTemplateError, UnsupportedContentError):
            self.render_plan(self.plan({"messages": [{"role": "user", "content": "Hi"}]}))

    def merges_inline_system(self) -> bool:
        """Whether vLLM merges an Anthropic request's inline system messages into the first one for this
        model: one of the templates it resolves (without tools, with an empty tool list) fails on a system
        message after the first (``anthropic_inputs.requires_system_first``)."""
        if self._merges_inline is None:  # (two threads may both probe: the answer is the same)
            variants: tuple[list[Any] | None, ...] = (None, [])
            self._merges_inline = any(
                requires_system_first(self._resolve(self._template, tools)) for tools in variants
            )
        return self._merges_inline

    def render_plan(self, plan: ChatPlan, placeholders: Mapping[str, str] | None = None) -> RenderedChat:
        """The prompt vLLM renders for a planned request (raises ``ChatTemplateError`` and subclasses).
        ``placeholders``: the model's placeholder text per modality when its processor is reproduced
        (media parts are then kept and listed); None: media parts raise ``UnsupportedContentError``."""
        kwargs = dict(plan.kwargs)
        tools = kwargs.pop("tools", None)
        chosen = kwargs.pop("chat_template", None)
        tokenize = kwargs.pop("tokenize", True)
        fmt = self._format(plan.format_template, plan.kwargs.get("tools"))
        sink = MediaSink(placeholders) if placeholders is not None else None
        conv = [conversation(m, fmt, n, sink) for n, m in enumerate(plan.messages)]
        postprocess(conv)
        template = self._resolve(chosen, tools)
        if template is None:
            raise NoChatTemplateError(
                "the tokenizer has no chat template; configure one (chat_template=... or the fleet file's "
                "chat_template) or pass one with the request"
            )
        conv = developer_to_system(conv, template)
        accepted = _APPLY_PARAMS | self._templates.variables(template)
        passed = {k: v for k, v in kwargs.items() if k in accepted and k not in ("chat_template", "tokenize")}
        for name in ("self", "conversation"):
            if name in passed:
                raise ChatTemplateError(f"chat template argument {name!r} collides with a parameter")
        if passed.get("return_assistant_tokens_mask"):
            raise ChatTemplateError(
                "return_assistant_tokens_mask requires return_dict=True and tokenize=True"
            )
        if passed.get("sanitize_control_tokens") and not tokenize:
            raise ChatTemplateError("sanitize_control_tokens=True requires tokenize=True")
        if tokenize and (
            passed.get("sanitize_control_tokens") or any(passed.get(k) for k in _TOKENIZER_ARGS)
        ):
            raise UnsupportedContentError("tokenizer arguments in chat_template_kwargs are not reproduced")
        variables = {k: v for k, v in passed.items() if k not in _APPLY_PARAMS}
        if "conversations" in variables or "messages" in variables:
            raise ChatTemplateError("chat template argument collides with the conversation")
        text = self._templates.render(
            template,
            conv,
            tools=tools,
            documents=passed.get("documents"),
            add_generation_prompt=passed.get("add_generation_prompt", False),
            continue_final_message=passed.get("continue_final_message", False),
            variables={**self._specials, **variables},
        )
        media = tuple(sink.refs) if sink is not None else ()
        if media and tokenize:
            raise UnsupportedContentError(
                "media with tokenize: true in chat_template_kwargs is not reproduced"
            )
        return RenderedChat(text, pre_tokenized=bool(tokenize), media=media)

    def _format(self, template: str | None, tools: Any) -> Literal["string", "openai"]:
        if self._content_format != "auto":
            return self._content_format
        resolved = self._resolve(template, tools)
        return "string" if resolved is None else self._templates.content_format(resolved)

    def _resolve(self, template: Any, tools: Any) -> str | None:
        """vLLM's template resolution (see the module doc); None when there is none."""
        own = self._own
        if template is not None:
            if isinstance(own, dict) and isinstance(template, str) and template in own:
                return own[template]
            if not isinstance(template, str):
                raise ChatTemplateError("chat_template must be a string")
            return template
        if isinstance(own, dict):
            if tools is not None and "tool_use" in own:
                return own["tool_use"]
            return own.get("default")
        return own


def chat_body(
    messages: Any,
    tools: Any = None,
    chat_template_kwargs: Any = None,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    documents: Any = None,
    add_special_tokens: bool = False,
) -> dict[str, Any]:
    """A ``/v1/chat/completions`` body with these fields (the optional ones only when given), for
    ``CachedTokenizer.encode_chat_request`` from arguments."""
    body: dict[str, Any] = {"messages": messages}
    if tools is not None:
        body["tools"] = tools
    if chat_template_kwargs is not None:
        body["chat_template_kwargs"] = chat_template_kwargs
    body["add_generation_prompt"] = add_generation_prompt
    body["continue_final_message"] = continue_final_message
    if chat_template is not None:
        body["chat_template"] = chat_template
    if documents is not None:
        body["documents"] = documents
    body["add_special_tokens"] = add_special_tokens
    return body
