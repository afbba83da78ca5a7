"""What vLLM 0.33 does to a prompt around tokenization: length checks and truncation, and the prompts of a
completions request.

For a text prompt (``TokenizeParams``), with ``max_model_len`` known:

1. before tokenizing: a text longer than ``max_model_len * (longest vocabulary entry)`` characters is
   refused, unless ``truncate_prompt_tokens`` is set; with ``truncation_side`` also set, it is cut to that
   many characters instead (from the left or the right);
2. tokenizing: with ``truncate_prompt_tokens`` (N >= 0, or -1 for ``max_model_len - 1``) and no
   ``truncation_side``, the tokenizer itself truncates to N tokens *including* the special tokens it
   adds, on its own side (``truncation_side`` of the tokenizer);
3. after: the ids are cut to N (``truncation_side`` or the tokenizer's side: "left" keeps the last N);
   more than ``max_model_len`` ids is refused; no ids at all is refused.

Ids given as the prompt (completions, or decode-side ids) skip steps 1 and 2.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .chat_request import TokenizeSpec, check_common, tokenize_spec
from .config import RenderOptions
from .errors import InvalidPromptError, RequestValidationError
from .request_schema import Invalid, lax_bool, lax_int

__all__ = [
    "CompletionPlan",
    "check_ids_length",
    "limit_text",
    "plan_completion",
    "token_limit",
    "truncate_ids",
]


def token_limit(spec: TokenizeSpec, options: RenderOptions) -> int | None:
    """N of ``truncate_prompt_tokens`` (None: no truncation)."""
    n = spec.truncate_prompt_tokens
    if n is None or n >= 0:
        return n
    return None if options.max_model_len is None else max(0, options.max_model_len - 1)


def limit_text(text: str, spec: TokenizeSpec, options: RenderOptions, max_chars_per_token: int) -> str:
    """Step 1: the character bound checked (or applied) before tokenizing."""
    if options.max_model_len is None:
        return text
    bound = options.max_model_len * max_chars_per_token
    if len(text) <= bound:
        return text
    if spec.truncate_prompt_tokens is None:
        raise RequestValidationError(
            f"the prompt has {len(text)} characters, more than {bound} "
            f"({options.max_model_len} tokens at most)"
        )
    if spec.truncation_side == "left":
        return text[-bound:]
    if spec.truncation_side == "right":
        return text[:bound]
    return text


def truncate_ids(ids: list[int], spec: TokenizeSpec, options: RenderOptions, default_side: str) -> list[int]:
    """Step 3's cut (before the length check)."""
    n = token_limit(spec, options)
    if n is None or n >= len(ids):
        return ids
    if n == 0:
        return []
    if (spec.truncation_side or default_side) == "left":
        return ids[-n:]
    return ids[:n]


def check_ids_length(ids: list[int], options: RenderOptions) -> list[int]:
    """Step 3's checks."""
    if options.max_model_len is not None and len(ids) > options.max_model_len:
        raise RequestValidationError(
            f"This model's maximum context length is {options.max_model_len} tokens. However, your prompt "
            f"contains {len(ids)} input tokens."
        )
    if not ids:
        raise RequestValidationError("No token_ids rendered")
    return ids


class CompletionPlan:
    """The prompts of a completions request (text or ids, in order) and how to tokenize them."""

    __slots__ = ("prompts", "tokenize")

    def __init__(self, prompts: list[str | list[int]], tokenize: TokenizeSpec) -> None:
        self.prompts = prompts
        self.tokenize = tokenize


def plan_completion(body: Mapping[str, Any], options: RenderOptions) -> CompletionPlan:
    """Read a completions request body as vLLM does (raises ``InvalidPromptError``)."""
    if not isinstance(body, Mapping):
        raise InvalidPromptError("the request body must be a JSON object")
    try:
        check_common(body, options)
        spec = tokenize_spec(body, add_special_default=True)
        echo = body.get("echo")
        if echo is not None:
            lax_bool(echo)
    except (RequestValidationError, Invalid) as e:
        raise InvalidPromptError(str(e)) from None
    prompt = body.get("prompt")
    embeds = body.get("prompt_embeds")
    if (prompt is None or prompt == "") and (embeds is None or embeds == []):
        raise InvalidPromptError("Either prompt or prompt_embeds must be provided and non-empty.")
    if embeds is not None and embeds != []:
        from .messages import UnsupportedContentError

        raise UnsupportedContentError("prompt_embeds are not supported by the router tokenizer")
    if body.get("suffix") is not None:
        raise InvalidPromptError("suffix is only supported for models with FIM completion rendering")
    return CompletionPlan(_prompts(prompt), spec)


def _ids(value: Any) -> list[int] | None:
    """``list[int >= 0]`` in pydantic's lax mode (integral floats, booleans, numeric strings), else None."""
    if type(value) is not list:
        return None
    try:
        ids = [lax_int(x) for x in value]
    except Invalid:
        return None
    return ids if all(x >= 0 for x in ids) else None


def _prompts(prompt: Any) -> list[str | list[int]]:
    """The prompt union (ids | lists of ids | text | texts), strings preferred where they fit exactly."""
    if prompt is None:
        return []
    if isinstance(prompt, str):
        return [prompt]
    if type(prompt) is not list:
        raise InvalidPromptError("prompt must be a string, a list of strings or a list of token ids")
    if not prompt:
        raise InvalidPromptError("You must pass at least one prompt")
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if (ids := _ids(prompt)) is not None:
        return [ids]
    lists = [_ids(p) for p in prompt]
    if all(x is not None for x in lists):
        return [x for x in lists if x is not None]
    raise InvalidPromptError("prompt must be a string, a list of strings or a list of token ids")
