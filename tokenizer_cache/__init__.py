"""Prompt tokens exactly as vLLM computes them, at a small fraction of the cost of tokenizing.

KV-aware routing needs the token ids vLLM will compute for a request: one token off at the start of a
block and every block hash differs.  Most of a prompt is usually text seen before (system prompts,
documents, conversation history), so ``CachedTokenizer`` keeps recent texts with their tokens and
re-tokenizes only past the longest cached prefix, backing off far enough that the result is identical to
a full tokenization (the argument: ``tokenizer_cache.seams``).

Entry points: ``CachedTokenizer.from_pretrained(path, ...)``; per request body ``encode_chat_request``,
``encode_completion_request``, ``encode_responses_request``, ``encode_messages_request`` (each with an
``aencode_`` twin for the event loop); ``encode_prompt`` / ``encode_chat`` (and ``_ex`` forms that also
report the reused prefix); ``TokenizerRegistry`` (one tokenizer per served model); errors under
``TokenizerCacheError``.  docs/tokenizer-cache.md describes each; docs/parity.md lists every step of
vLLM's request path that is reproduced, with its source.
"""

from __future__ import annotations

from .cached import CachedTokenizer, Encoded
from .chat import RenderedChat, UnsupportedContentError
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
    "default_tokenizer_path",
    "load_chat_template",
]
