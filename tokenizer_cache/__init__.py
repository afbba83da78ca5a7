"""Prompt tokens exactly as vLLM computes them, at a small fraction of the cost of tokenizing.

KV-aware routing needs the token ids vLLM will compute for a request: one token off at the start of a
block and every block hash differs.  Most of a prompt is usually text seen before (system prompts,
documents, conversation history), so ``CachedTokenizer`` keeps recent texts with their tokens and
re-tokenizes only past the longest cached prefix, backing off far enough that the result is identical to
a full tokenization (``splice_cache``; the argument: ``seams``).

Entry points: ``CachedTokenizer.from_pretrained(path, ...)``; one per request kind,
``encode_chat_request``, ``encode_completion_request``, ``encode_responses_request``,
``encode_messages_request``, and ``encode_prompt`` for a bare prompt, each with an ``aencode_`` twin for
the event loop and each answering an ``Encoded`` (the ids and the reused prefix); ``chat_body`` (a chat
body from arguments); ``TokenizerRegistry`` (one tokenizer per served model); errors under
``TokenizerCacheError``.  docs/tokenizer-cache.md describes each; docs/parity.md lists every step of
vLLM's request path that is reproduced, with its source."""

from __future__ import annotations

from .cached import CachedTokenizer, Encoded
from .chat import RenderedChat, UnsupportedContentError, chat_body
from .config import CacheConfig, CacheStats, RenderOptions
from .errors import (
    ChatTemplateError,
    InvalidPromptError,
    NoChatTemplateError,
    RequestValidationError,
    TokenizerCacheError,
    TokenizerLoadError,
)
from .loading import default_tokenizer_path, load_chat_template
from .registry import Loader, TokenizerRegistry

__all__ = [
    "CacheConfig",
    "CacheStats",
    "CachedTokenizer",
    "ChatTemplateError",
    "Encoded",
    "InvalidPromptError",
    "Loader",
    "NoChatTemplateError",
    "RenderOptions",
    "RenderedChat",
    "RequestValidationError",
    "TokenizerCacheError",
    "TokenizerLoadError",
    "TokenizerRegistry",
    "UnsupportedContentError",
    "chat_body",
    "default_tokenizer_path",
    "load_chat_template",
]
