"""Configuration and statistics of a cached tokenizer (msgspec Structs, documented per field)."""

from __future__ import annotations

import os
from typing import Any, Literal

import msgspec

from .errors import TokenizerLoadError

__all__ = ["CacheConfig", "CacheStats", "RenderOptions"]


def _default_workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))


class CacheConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How the prefix cache of one ``CachedTokenizer`` is sized and how far it backs off at a seam."""

    max_cache_bytes: int = 256 * 1024 * 1024
    """Upper bound of the bytes held by cached entries (text, token ids, seams, trie keys; estimated
    conservatively).  The least recently used entries are evicted to stay under it."""

    chunk_chars: int = 1024
    """Granularity of the datrie index: texts are cut into chunks of this many characters and each
    chunk-aligned prefix gets one trie key.  Texts shorter than one chunk are never cached (they take
    under half a millisecond to tokenize), and a reuse needs one whole chunk in common; the shared prefix
    itself is then found to the character.  Larger chunks mean fewer digests and shorter trie keys
    (docs/measurements.md, "tokenizer cache")."""

    margin_chars: int = 16
    """Minimum distance, in characters, between the end of the text shared with a cached entry and the
    reuse boundary (it covers the pre-tokenizer's look-ahead).  Grows by the longest added token when
    one may start just before the end of the shared text."""

    overlap_chars: int = 16
    """At least this many characters before the reuse boundary are tokenized again and must reproduce
    the cached tokens exactly (the resynchronisation check)."""

    seam_stride_tokens: int = 16
    """One reuse-boundary candidate (a word start) is recorded per this many tokens of a cached entry."""

    seam_tail_tokens: int = 512
    seam_tail_stride_tokens: int = 4
    """Denser candidates, one per ``seam_tail_stride_tokens``, in the last ``seam_tail_tokens`` of an entry:
    the next request usually leaves the cached text there (a new question after a shared prefix, the next
    chat turn), and the re-tokenized part shrinks with the distance to the last candidate.  0: uniform."""

    min_new_chars: int = 256
    """A text spliced from a cached entry is cached itself only when it goes at least this many
    characters past the prefix it shares with that entry.  A request that differs from a cached text by a
    short tail (a question after a shared system prompt) costs a lookup and a short encode; caching it
    too would cost more than re-encoding its tail later, and fill the cache with near-copies of one
    prompt that evict the entries worth keeping.  0: every spliced text is cached."""

    executor_workers: int = msgspec.field(default_factory=_default_workers)
    """Threads of the executor that the async methods use when no executor is passed in."""

    inline_chars: int = 1024
    """The async methods run encodes of up to this many characters (what is left to tokenize after the
    cache: a question after a cached prefix) on the calling thread, longer ones on the executor.  A hop to
    the executor and back costs about what tokenizing this many characters does (docs/measurements.md,
    "tokenizer cache").  Longer encodes go to the executor even so: there the Rust tokenizer runs without
    the GIL, alongside the event loop's other work, which matters more than the hop once the gateway is
    busy.  0: every encode on the executor."""

    def validate(self) -> CacheConfig:
        """Check cross-field constraints once; return self so it can be chained."""
        if self.max_cache_bytes < 0:
            raise TokenizerLoadError("max_cache_bytes must be >= 0")
        if self.chunk_chars < 16:
            raise TokenizerLoadError("chunk_chars must be >= 16")
        if self.margin_chars < 1 or self.overlap_chars < 1:
            raise TokenizerLoadError("margin_chars and overlap_chars must be >= 1")
        if self.seam_stride_tokens < 1:
            raise TokenizerLoadError("seam_stride_tokens must be >= 1")
        if self.seam_tail_tokens < 0 or self.seam_tail_stride_tokens < 0:
            raise TokenizerLoadError("seam_tail_tokens and seam_tail_stride_tokens must be >= 0")
        if self.inline_chars < 0:
            raise TokenizerLoadError("inline_chars must be >= 0")
        if self.min_new_chars < 0:
            raise TokenizerLoadError("min_new_chars must be >= 0")
        if self.executor_workers < 1:
            raise TokenizerLoadError("executor_workers must be >= 1")
        return self


class RenderOptions(msgspec.Struct, frozen=True, kw_only=True):
    """The vLLM server flags that change how a chat request is rendered, as the fleet runs them.

    The router cannot see the flags, so the ones that make vLLM *refuse* a request default to "unknown"
    (None): the request is then rendered as if vLLM accepted it.  Refusing what vLLM accepts would turn
    working requests into errors; rendering what vLLM refuses only routes a request that fails anyway."""

    chat_template_content_format: Literal["auto", "string", "openai"] = "auto"
    """``--chat-template-content-format``: how message content reaches the template ("auto": detected from
    the template, as vLLM does)."""

    default_chat_template_kwargs: dict[str, Any] | None = None
    """``--default-chat-template-kwargs``: template arguments under the request's own."""

    exclude_tools_when_tool_choice_none: bool = False
    """``--exclude-tools-when-tool-choice-none``: a request with ``tool_choice: "none"`` renders no tools."""

    reasoning_effort_map: dict[str, str] | None = None
    """``--reasoning-effort-map``: ``reasoning_effort`` values renamed before they reach the template."""

    trust_request_chat_template: bool | None = None
    """``--trust-request-chat-template``.  False: a request carrying a chat template is refused, as vLLM
    does by default.  None (unknown): such requests are rendered with their template."""

    tool_parser: bool | None = None
    """Whether vLLM runs with ``--enable-auto-tool-choice --tool-call-parser``.  False: a ``tool_choice``
    other than "none" (the default once ``tools`` are given is "auto") is refused, as vLLM without a
    parser does.  None (unknown): accepted."""

    trust_request_mm_kwargs: bool | None = None
    """``--trust-request-mm-kwargs``.  False: requests with ``mm_processor_kwargs``/``media_io_kwargs`` are
    refused.  None (unknown): accepted."""

    max_model_len: int | None = None
    """The model's context length (``--max-model-len`` or its config).  Set: prompts longer than this are
    refused, ``truncate_prompt_tokens: -1`` keeps ``max_model_len - 1`` tokens, and ``max_tokens`` above it
    is refused.  None: no length checks (and ``-1`` truncates nothing)."""

    mm_processor_kwargs: dict[str, Any] | None = None
    """``--mm-processor-kwargs``: the server's processor arguments (they change placeholder counts, e.g.
    Gemma 3's ``do_pan_and_scan`` or Qwen-VL's ``max_pixels``; not the items' hashes)."""

    max_image_pixels: int = 0
    """vLLM's ``VLLM_MAX_IMAGE_PIXELS`` (0: no limit): larger images are refused."""

    @classmethod
    def from_vllm_args(cls, args: list[str], *, max_model_len: int | None = None) -> RenderOptions:
        """The options of a vLLM server started with these command-line arguments (the flags above; others
        are ignored).  Flags that are absent mean vLLM's defaults, not "unknown"."""

        def value(flag: str) -> str | None:
            for i, a in enumerate(args):
                if a == flag and i + 1 < len(args):
                    return args[i + 1]
                if a.startswith(flag + "="):
                    return a.split("=", 1)[1]
            return None

        def json_value(flag: str) -> Any:
            raw = value(flag)
            return None if raw is None else msgspec.json.decode(raw)

        fmt = value("--chat-template-content-format") or "auto"
        if fmt not in ("auto", "string", "openai"):
            raise TokenizerLoadError(f"--chat-template-content-format {fmt!r} is not auto, string or openai")
        length = value("--max-model-len")
        return cls(
            chat_template_content_format=fmt,  # type: ignore[arg-type]
            default_chat_template_kwargs=json_value("--default-chat-template-kwargs"),
            exclude_tools_when_tool_choice_none="--exclude-tools-when-tool-choice-none" in args,
            reasoning_effort_map=json_value("--reasoning-effort-map"),
            trust_request_chat_template="--trust-request-chat-template" in args,
            tool_parser=value("--tool-call-parser") is not None,
            trust_request_mm_kwargs="--trust-request-mm-kwargs" in args,
            mm_processor_kwargs=json_value("--mm-processor-kwargs"),
            max_model_len=int(length) if length is not None else max_model_len,
        ).validate()

    def validate(self) -> RenderOptions:
        if self.max_model_len is not None and self.max_model_len < 1:
            raise TokenizerLoadError("max_model_len must be >= 1")
        return self


class CacheStats(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of one ``CachedTokenizer``'s counters (``hits + misses + fallbacks == lookups``)."""

    lookups: int
    """Texts long enough to be looked up in the prefix cache."""
    hits: int
    """Lookups that reused cached tokens (exact repeats included)."""
    exact_hits: int
    """Hits whose whole text was cached: no tokenization at all."""
    misses: int
    """Lookups with no usable cached prefix: the text was tokenized in full."""
    fallbacks: int
    """Lookups whose seam failed the resynchronisation check: the text was tokenized in full."""
    tokens_reused: int
    """Tokens copied from the cache instead of being computed."""
    tokens_encoded: int
    """Tokens produced by the tokenizer (overlap re-tokenization included), over all calls."""
    bytes_held: int
    """Estimated bytes held by the cached entries."""
    entries: int
    """Cached entries (one per distinct cached text)."""
    evictions: int
    """Entries evicted to stay under ``max_cache_bytes``."""
    reuse_enabled: bool
    """False when the tokenizer's pipeline is outside the set the seam argument covers (every lookup
    then misses by construction and nothing is cached)."""
