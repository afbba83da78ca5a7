"""``CachedTokenizer``: prompt tokens exactly as vLLM builds them, reusing cached prefixes.

One entry per request kind (``encode_chat_request``, ``encode_completion_request``,
``encode_responses_request``, ``encode_messages_request``) and ``encode_prompt`` for a bare prompt, each
with an ``aencode_`` twin, each answering an ``Encoded``.  A request is planned and rendered as vLLM does
(``chat``, ``responses_request``, ``anthropic_inputs``, ``prompt_limits``), its content tokens come from
the prefix cache (``splice_cache.SpliceCache``), and the tokenizer's special tokens are put around them.

Tokenization always runs outside the index lock and releases the GIL (see ``_encode``).  The async
methods do the cache's own work (digests, lookup, splicing) on the calling event loop, and so the
encodes of up to ``inline_chars`` characters, since a hop to a thread costs about as much as tokenizing
a short question (docs/measurements.md, "Tokenizer cache"); longer encodes go to a thread pool, where
they run without the GIL alongside the loop's other work."""

from __future__ import annotations

import asyncio
import copy
import functools
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, NamedTuple, TypeVar

import numpy as np

from .anthropic_inputs import disabled_thinking_effort, messages_request
from .chat import ChatRenderer, ContentFormat, RenderedChat
from .chat_request import ChatPlan, TokenizeSpec
from .config import CacheConfig, CacheStats, RenderOptions
from .errors import InvalidPromptError, RequestValidationError, UnsupportedContentError
from .loading import HFTokenizer, load_chat_template, load_hf_tokenizer, raw_backend, special_wrap
from .mm.processors import UnknownProcessor
from .mm.prompt import MMItem, MultimodalModel
from .prefix_index import U32Array, ids_array
from .prompt_limits import check_ids_length, limit_text, plan_completion, token_limit, truncate_ids
from .seams import AddedTokenMargin, reuse_blockers, start_sensitive
from .splice_cache import IdsOnly, SpliceCache, Steps

__all__ = ["CachedTokenizer", "Encoded"]

Prompt = str | Sequence[int]
# vLLM loads the tokenizers of generative models with truncation_side="left" (tokenizers/registry.py).
TRUNCATION_SIDE = "left"
_T = TypeVar("_T")


def _advance(steps: Steps[_T], sent: Any) -> tuple[bool, Any]:
    """One step: (False, the next text to tokenize) or (True, the result).  StopIteration may not cross
    an executor's future, so it is turned into a value here."""
    try:
        return False, (next(steps) if sent is None else steps.send(sent))
    except StopIteration as stop:
        return True, stop.value


class Encoded(NamedTuple):
    """Prompt tokens, and how many of the leading ones came from the cache (specials included).

    ``array``: the same ids as uint32 when the cache had them at hand (a reused prefix, a miss that was
    just cached), else None; ``token_array()`` always answers."""

    tokens: list[int]
    reused_tokens: int
    array: U32Array | None = None
    mm: tuple[MMItem, ...] = ()
    """The prompt's multimodal items (identifier, placeholder range), sorted by offset."""
    complete: bool = True
    """False: ``tokens`` are the exact prefix before a media item the router cannot expand."""
    media_paths: tuple[str, ...] = ()
    """How each media item was learnt (``tokenizer_cache.mm.items.ItemPath``), in prompt order."""

    def token_array(self) -> U32Array:
        return self.array if self.array is not None else ids_array(self.tokens)


class CachedTokenizer:
    """One model's tokenizer with a prefix cache.  Thread-safe; see the package docstring."""

    def __init__(
        self,
        tok: HFTokenizer,
        *,
        config: CacheConfig | None = None,
        chat_template: str | None = None,
        content_format: ContentFormat | None = None,
        executor: Executor | None = None,
        render_options: RenderOptions | None = None,
        multimodal: MultimodalModel | None = None,
    ) -> None:
        """``multimodal``: the model's processor family and media resolver (``tokenizer_cache.mm``); without
        it a request with media raises ``UnsupportedContentError``."""
        self.config = cfg = (config or CacheConfig()).validate()
        self.multimodal = multimodal
        self._placeholders = multimodal.placeholders if multimodal is not None else None
        self.hf_tokenizer = tok
        self.name_or_path: str = str(getattr(tok, "name_or_path", ""))
        self._raw, spec = raw_backend(tok)
        self._fast: Callable[..., Any] | None = getattr(self._raw, "encode_batch_fast", None)
        """Encodes without offsets (tokenizers >= 0.21); None before."""
        self._wrap = special_wrap(tok, self._raw)
        self.reuse_blockers = reuse_blockers(spec)
        self._reuse = not self.reuse_blockers and cfg.max_cache_bytes > 0
        self._cache = SpliceCache(
            cfg, reuse=self._reuse, added_margin=AddedTokenMargin(spec), prefer_space=start_sensitive(spec)
        )
        self._renderer = ChatRenderer(
            tok,
            chat_template=load_chat_template(chat_template) if chat_template else None,
            content_format=content_format,
            options=render_options,
        )
        self.render_options = self._renderer.options
        self._max_chars_per_token = 0
        self._disabled_effort: str | None = None
        self._hf_left: HFTokenizer | None = None
        self.vocab_size = max(self._raw.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        self._executor = executor
        self._owns_executor = executor is None
        self._executor_lock = threading.Lock()

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        *,
        max_cache_bytes: int | None = None,
        chunk_chars: int | None = None,
        allow_download: bool = False,
        chat_template: str | None = None,
        config: CacheConfig | None = None,
        content_format: ContentFormat | None = None,
        executor: Executor | None = None,
        render_options: RenderOptions | None = None,
        mm_model_id: str | None = None,
    ) -> CachedTokenizer:
        """Load the tokenizer at ``path`` (a directory or a hub name in the local HF cache).  A directory
        whose processor this package reproduces (``tokenizer_cache.mm``) also gets multimodal support, its
        items hashed with ``mm_model_id`` (vLLM's ``--model`` as given; default ``path``)."""
        cfg = config or CacheConfig()
        overrides: dict[str, int] = {}
        if max_cache_bytes is not None:
            overrides["max_cache_bytes"] = max_cache_bytes
        if chunk_chars is not None:
            overrides["chunk_chars"] = chunk_chars
        if overrides:
            cfg = CacheConfig(**{**{f: getattr(cfg, f) for f in cfg.__struct_fields__}, **overrides})
        tok = load_hf_tokenizer(path, allow_download=allow_download)
        opts = (render_options or RenderOptions()).validate()
        mm = None
        directory = _model_directory(path)
        try:
            mm = MultimodalModel.load(
                directory,
                tok,
                model_id=mm_model_id or path,
                mm_processor_kwargs=opts.mm_processor_kwargs,
                max_image_pixels=opts.max_image_pixels,
            )
        except (UnknownProcessor, OSError, KeyError, ValueError):
            mm = None  # not a model whose processor is reproduced: media requests route without ids
        return cls(
            tok,
            config=cfg,
            chat_template=chat_template,
            content_format=content_format,
            executor=executor,
            render_options=opts,
            multimodal=mm,
        )

    # -- public sync API ------------------------------------------------------------------------

    def encode_prompt(self, prompt: Prompt, *, add_special_tokens: bool = True) -> Encoded:
        """Tokens of a completions prompt: text with special tokens (BOS...), or token ids as given; with
        how many leading tokens were reused from the cache."""
        if isinstance(prompt, str):
            return self._encode_text(prompt, add_special_tokens)
        return Encoded(self._check_ids(prompt), 0)

    # -- whole requests: what the gateway calls ---------------------------------------------------

    def render_chat_request(self, body: Mapping[str, Any]) -> RenderedChat:
        """The prompt text vLLM renders for a chat request body (ignores ``kv_transfer_params`` ids)."""
        return self._renderer.render_plan(self._renderer.plan(body))

    def encode_chat_request(self, body: Mapping[str, Any]) -> Encoded:
        """The prompt tokens vLLM computes for a ``/v1/chat/completions`` body, as the client sent it.

        Every field vLLM reads is honoured (``docs/parity.md``); what vLLM answers with a 400 raises
        ``ChatTemplateError`` (``RequestValidationError`` for the request's shape), media content raises
        ``UnsupportedContentError``, a missing template ``NoChatTemplateError``."""
        return self._encode_planned(self._renderer.plan(body))

    def encode_responses_request(
        self,
        body: Mapping[str, Any],
        *,
        previous_messages: Sequence[Mapping[str, Any]] | None = None,
        previous_output: Sequence[Mapping[str, Any]] | None = None,
    ) -> Encoded:
        """The prompt tokens vLLM computes for a ``/v1/responses`` body (``responses_request``): raises
        ``AgentInputError`` / ``ChatTemplateError`` where vLLM answers 400.  ``previous_messages`` and
        ``previous_output``: what an instance stored for the body's ``previous_response_id``."""
        return self._encode_planned(
            self._renderer.plan_responses(
                body, previous_messages=previous_messages, previous_output=previous_output
            )
        )

    def encode_messages_request(self, body: Mapping[str, Any], *, count_tokens: bool = False) -> Encoded:
        """The prompt tokens vLLM computes for an Anthropic ``/v1/messages`` body (``anthropic_inputs``;
        ``count_tokens``: a ``/v1/messages/count_tokens`` body)."""
        return self._encode_planned(self._messages_plan(body, count_tokens))

    def _messages_plan(self, body: Mapping[str, Any], count_tokens: bool) -> ChatPlan:
        converted = messages_request(
            body,
            merge_inline_system=self._renderer.merges_inline_system(),
            disabled_effort=self.disabled_thinking_effort(),
            count_tokens=count_tokens,
        )
        return self._renderer.plan(converted.body, converted.assigned)

    def disabled_thinking_effort(self) -> str:
        """The reasoning effort vLLM gives Anthropic's ``thinking: {type: disabled}`` for this model: "none",
        or "low" when the template fails on "none" or renders it like a thinking effort (probed once)."""
        if self._disabled_effort is None:

            def render(kwargs: dict[str, Any]) -> object:
                probe = {
                    "messages": [{"role": "user", "content": "Hi"}],
                    "reasoning_effort": kwargs["reasoning_effort"],
                }
                return self.encode_chat_request(probe).tokens

            self._disabled_effort = disabled_thinking_effort(render)
        return self._disabled_effort

    def _encode_planned(self, plan: ChatPlan) -> Encoded:
        if plan.reuse_ids is not None:
            return Encoded(self._reused(plan.reuse_ids, plan.tokenize), 0)
        rendered = self._renderer.render_plan(plan, self._placeholders)
        self._media_supported(rendered, plan.tokenize)
        if self._truncates_in_tokenizer(rendered, plan.tokenize):
            return self._limited(Encoded(self._truncated(rendered, plan.tokenize), 0), plan.tokenize)
        text = self._text_for(rendered, plan.tokenize)
        enc = self._encode_text(text, self._adds_specials(rendered, plan.tokenize))
        return self._limited(self._expanded(enc, rendered), plan.tokenize)

    async def aencode_chat_request(self, body: Mapping[str, Any]) -> Encoded:
        """``encode_chat_request`` from the event loop: short plain conversations are rendered here, others on
        the executor; tokenization as in ``aencode_prompt``."""
        return await self._aencode_planned(self._renderer.plan(body), self._plain_chat(body))

    async def aencode_responses_request(
        self,
        body: Mapping[str, Any],
        *,
        previous_messages: Sequence[Mapping[str, Any]] | None = None,
        previous_output: Sequence[Mapping[str, Any]] | None = None,
    ) -> Encoded:
        """``encode_responses_request`` from the event loop (rendered on the executor)."""
        plan = self._renderer.plan_responses(
            body, previous_messages=previous_messages, previous_output=previous_output
        )
        return await self._aencode_planned(plan, False)

    async def aencode_messages_request(
        self, body: Mapping[str, Any], *, count_tokens: bool = False
    ) -> Encoded:
        """``encode_messages_request`` from the event loop (rendered on the executor)."""
        if self._disabled_effort is None:
            await self._run(self.disabled_thinking_effort, False)
        return await self._aencode_planned(self._messages_plan(body, count_tokens), False)

    async def _aencode_planned(self, plan: ChatPlan, inline: bool) -> Encoded:
        if plan.reuse_ids is not None:
            return Encoded(self._reused(plan.reuse_ids, plan.tokenize), 0)
        render = functools.partial(self._renderer.render_plan, plan, self._placeholders)
        rendered = await self._run(render, inline and self._placeholders is None)
        spec = plan.tokenize
        self._media_supported(rendered, spec)
        if self._truncates_in_tokenizer(rendered, spec):
            ids = await self._run(functools.partial(self._truncated, rendered, spec), False)
            return self._limited(Encoded(ids, 0), spec)
        text = self._text_for(rendered, spec)
        add = self._adds_specials(rendered, spec)
        if add and self._wrap is None:
            enc = await self._run(
                functools.partial(self._encode_text, text, add), len(text) <= self.config.inline_chars
            )
        else:
            enc = await self._adrive(self._text_steps(text, add))
        if rendered.media:  # resolving items decodes and hashes their bytes: off the event loop
            enc = await self._run(functools.partial(self._expanded, enc, rendered), False)
        return self._limited(enc, spec)

    def encode_completion_request(self, body: Mapping[str, Any]) -> list[Encoded]:
        """The prompt tokens vLLM computes for each prompt of a ``/v1/completions`` body (in order).

        Raises ``InvalidPromptError`` for what vLLM answers with a 400 (out-of-vocabulary ids too: vLLM's
        engine refuses them), ``UnsupportedContentError`` for ``prompt_embeds``."""
        plan = plan_completion(body, self.render_options)
        try:
            return [self._completion_prompt(p, plan.tokenize) for p in plan.prompts]
        except RequestValidationError as e:
            raise InvalidPromptError(str(e)) from None

    async def aencode_completion_request(self, body: Mapping[str, Any]) -> list[Encoded]:
        """``encode_completion_request`` from the event loop (see ``aencode_prompt``)."""
        plan = plan_completion(body, self.render_options)
        spec = plan.tokenize
        out = []
        try:
            for p in plan.prompts:
                if isinstance(p, str) and not self._truncates_in_tokenizer(RenderedChat(p), spec):
                    text = self._text_for(RenderedChat(p), spec)
                    enc = await self.aencode_prompt(text, add_special_tokens=spec.add_special_tokens)
                    out.append(self._limited(enc, spec))
                else:
                    out.append(await self._run(functools.partial(self._completion_prompt, p, spec), False))
        except RequestValidationError as e:
            raise InvalidPromptError(str(e)) from None
        return out

    def encode_uncached(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Reference tokenization through transformers, bypassing the cache (tests, benchmarks)."""
        return list(self.hf_tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def stats(self) -> CacheStats:
        index = self._cache.index
        return CacheStats(
            **self._cache.counts(),
            bytes_held=index.bytes_held,
            entries=len(index),
            evictions=index.evictions,
            reuse_enabled=self._reuse,
        )

    def clear(self) -> None:
        """Drop every cached entry (counters are kept)."""
        self._cache.index.clear()

    def check_invariants(self) -> None:
        """Assert the prefix index's invariants (tests)."""
        self._cache.index.check_invariants()

    # -- async API ------------------------------------------------------------------------------

    def _pool(self) -> Executor:
        with self._executor_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    max_workers=self.config.executor_workers, thread_name_prefix="tokenizer"
                )
            return self._executor

    async def aencode_prompt(self, prompt: Prompt, *, add_special_tokens: bool = True) -> Encoded:
        """``encode_prompt`` from the event loop: the cache's own work here, long encodes on the executor
        (see ``CacheConfig.inline_chars``)."""
        if isinstance(prompt, str) and not (add_special_tokens and self._wrap is None):
            return await self._adrive(self._text_steps(prompt, add_special_tokens))
        # Token ids (checking 100k of them takes milliseconds), or a text that transformers tokenizes
        # whole (a post-processor that is not a fixed prefix/suffix): one call, long ones off the loop.
        call = functools.partial(self.encode_prompt, prompt, add_special_tokens=add_special_tokens)
        return await self._run(call, len(prompt) <= self.config.inline_chars)

    async def _run(self, call: Callable[[], _T], inline: bool) -> _T:
        if inline:
            return call()
        return await asyncio.get_running_loop().run_in_executor(self._pool(), call)

    @staticmethod
    def _plain_chat(body: Mapping[str, Any]) -> bool:
        """Plain-text messages with no tools or documents: rendering them is string concatenation in the
        template, microseconds even for a long conversation.  Tools and documents (JSON schemas rendered
        by the template) can take milliseconds: those are rendered on the executor."""
        messages = body.get("messages")
        if body.get("tools") or body.get("documents") or not isinstance(messages, list):
            return False
        return all(
            isinstance(m, Mapping) and isinstance(m.get("content"), (str, type(None))) for m in messages
        )

    def warm(self) -> None:
        """Compute now what the first requests would (the vocabulary's longest entry, the chat template's
        compiled form and probes): ``kvrouter serve`` does it before forking its workers, so none of them
        does it again, each for itself, on its first requests.  Tokenizes nothing."""
        _ = self.max_chars_per_token
        self._renderer.warm()

    # -- prompt limits (``prompt_limits``) --------------------------------------------------------

    @property
    def max_chars_per_token(self) -> int:
        """The longest vocabulary entry, in characters (vLLM's bound on a prompt's characters per token)."""
        if not self._max_chars_per_token:
            self._max_chars_per_token = max(map(len, self.hf_tokenizer.get_vocab()), default=1)
        return self._max_chars_per_token

    @staticmethod
    def _adds_specials(rendered: RenderedChat, spec: TokenizeSpec) -> bool:
        return spec.add_special_tokens and not rendered.pre_tokenized

    def _truncates_in_tokenizer(self, rendered: RenderedChat, spec: TokenizeSpec) -> bool:
        """vLLM lets the tokenizer truncate (specials kept) when only ``truncate_prompt_tokens`` is set."""
        return (
            not rendered.pre_tokenized
            and spec.truncation_side is None
            and token_limit(spec, self.render_options) is not None
        )

    def _text_for(self, rendered: RenderedChat, spec: TokenizeSpec) -> str:
        if rendered.pre_tokenized:
            return rendered.text
        return limit_text(rendered.text, spec, self.render_options, self.max_chars_per_token)

    def _truncated(self, rendered: RenderedChat, spec: TokenizeSpec) -> list[int]:
        """The tokenizer's own truncation to N tokens: specials kept, content cut on vLLM's side (left)."""
        text = self._text_for(rendered, spec)
        n = token_limit(spec, self.render_options)
        assert n is not None
        add = self._adds_specials(rendered, spec)
        wrap = self._wrap if add else None
        if add and wrap is None:
            with self._executor_lock:  # a private copy: truncation settings live on the Rust object
                if self._hf_left is None:
                    self._hf_left = copy.deepcopy(self.hf_tokenizer)
                    self._hf_left.truncation_side = TRUNCATION_SIDE
                try:
                    return list(
                        self._hf_left(text, truncation=True, max_length=n, add_special_tokens=True)[
                            "input_ids"
                        ]
                    )
                except Exception as e:  # a max_length below the special tokens
                    raise RequestValidationError(f"cannot truncate the prompt to {n} tokens: {e}") from e
        content = self._encode_text(text, False).tokens
        keep = n - (len(wrap.prefix) + len(wrap.suffix) if wrap is not None else 0)
        if keep < 0:
            raise RequestValidationError(
                f"cannot truncate the prompt to {n} tokens: its special tokens are more"
            )
        content = content[-keep:] if keep else []
        return wrap.apply(content) if wrap is not None else content

    def _media_supported(self, rendered: RenderedChat, spec: TokenizeSpec) -> None:
        if rendered.media and (spec.truncate_prompt_tokens is not None or rendered.pre_tokenized):
            raise UnsupportedContentError("truncation of a multimodal prompt is not reproduced")

    def _expanded(self, enc: Encoded, rendered: RenderedChat) -> Encoded:
        """The ids with the media placeholders expanded as vLLM expands them (``tokenizer_cache.mm``)."""
        if not rendered.media:
            return enc
        assert self.multimodal is not None  # media are only listed when a model has one
        p = self.multimodal.expand(enc.tokens, rendered.media)
        head = min(enc.reused_tokens, p.items[0].offset if p.items else len(p.ids), len(p.ids))
        return Encoded(p.ids, head, None, p.items, p.complete, p.paths)

    def _limited(self, enc: Encoded, spec: TokenizeSpec) -> Encoded:
        if enc.mm or not enc.complete:  # no truncation with media (refused before rendering)
            if enc.complete:
                check_ids_length(enc.tokens, self.render_options)
            return enc
        ids = truncate_ids(enc.tokens, spec, self.render_options, TRUNCATION_SIDE)
        if ids is not enc.tokens:
            head = enc.reused_tokens if enc.tokens[: len(ids)] == ids else 0
            enc = Encoded(ids, min(head, len(ids)))
        check_ids_length(enc.tokens, self.render_options)
        return enc

    def _reused(self, ids: list[int], spec: TokenizeSpec) -> list[int]:
        limit = self.render_options.max_model_len
        if limit is not None and spec.truncate_prompt_tokens is None and len(ids) > limit:
            raise RequestValidationError(
                f"Input length ({len(ids)}) exceeds model's maximum context length ({limit})."
            )
        return ids

    def _completion_prompt(self, prompt: str | list[int], spec: TokenizeSpec) -> Encoded:
        if not isinstance(prompt, str):
            return self._limited(Encoded(self._check_ids(prompt), 0), spec)
        rendered = RenderedChat(prompt)
        if self._truncates_in_tokenizer(rendered, spec):
            return self._limited(Encoded(self._truncated(rendered, spec), 0), spec)
        return self._limited(self._encode_text(self._text_for(rendered, spec), spec.add_special_tokens), spec)

    def close(self) -> None:
        """Shut down the executor if this object created it."""
        with self._executor_lock:
            ex, self._executor = self._executor, (None if self._owns_executor else self._executor)
        if self._owns_executor and ex is not None:
            ex.shutdown(wait=True)

    def __enter__(self) -> CachedTokenizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------------

    def _check_ids(self, ids: Sequence[int]) -> list[int]:
        if isinstance(ids, (bytes, bytearray)) or not isinstance(ids, Sequence):
            raise InvalidPromptError("a prompt must be a string or a list of token ids")
        out = list(ids)
        vocab = self.vocab_size
        for t in out:
            if type(t) is not int or not 0 <= t < vocab:  # bool is not a token id
                raise InvalidPromptError(f"token id {t!r} is not in the vocabulary (0..{vocab - 1})")
        return out

    def _encode_text(self, text: str, add_special_tokens: bool) -> Encoded:
        return self._drive(self._text_steps(text, add_special_tokens))

    def _text_steps(self, text: str, add_special_tokens: bool) -> Steps[Encoded]:
        """The cached path as steps: it yields each text it needs tokenized and is resumed with that
        text's ``tokenizers.Encoding``.  ``_drive`` runs it on one thread; ``_adrive`` runs the Python
        steps (digests, lookup, splice, caching) where it is called and sends long encodes, with what
        follows them, to the executor."""
        wrap = self._wrap if add_special_tokens else None
        if add_special_tokens and wrap is None:
            # The post-processor is not a fixed prefix/suffix: let transformers do it, uncached.
            ids = self.encode_uncached(text, add_special_tokens=True)
            self._cache.count(tokens_encoded=len(ids))
            return Encoded(ids, 0)
        content, reused, arr = yield from self._cache.content(text)
        if wrap is None or not (wrap.prefix or wrap.suffix):
            return Encoded(content, reused, arr)
        if arr is not None:
            arr = np.concatenate((ids_array(wrap.prefix), arr, ids_array(wrap.suffix)))
        return Encoded(wrap.apply(content), len(wrap.prefix) + reused if reused else 0, arr)

    def _drive(self, steps: Steps[_T]) -> _T:
        """Run ``steps`` to the end on this thread."""
        try:
            part = next(steps)
            while True:
                part = steps.send(self._encode(part))
        except StopIteration as stop:
            return stop.value

    async def _adrive(self, steps: Steps[_T]) -> _T:
        """Run ``steps`` from the event loop: the Python steps and encodes of up to ``inline_chars``
        characters here (a hop to the executor and back costs more than either); a longer encode, and
        the steps after it (a miss caches 8k tokens: a millisecond of Python), on the executor."""
        loop = asyncio.get_running_loop()
        done, value = _advance(steps, None)
        while not done:
            step = functools.partial(self._encode_and_advance, steps, value)
            if len(value) <= self.config.inline_chars:
                done, value = step()
            else:
                done, value = await loop.run_in_executor(self._pool(), step)
        return value

    def _encode_and_advance(self, steps: Steps[Any], part: str) -> tuple[bool, Any]:
        return _advance(steps, self._encode(part))

    def _encode(self, text: str) -> Any:
        """Content encoding of ``text`` (a ``tokenizers.Encoding``); an ``IdsOnly`` text's without the
        character offsets (``encode_batch_fast``: a sixth less work on a short text; its ids alone are read).

        NOTE: ``encode_batch`` releases the GIL and ``encode`` does not (tokenizers 0.15-0.23), so a
        one-text batch lets other threads, and the event loop, run while the Rust code works.
        """
        if type(text) is IdsOnly and self._fast is not None:
            return self._fast([text], add_special_tokens=False)[0]
        return self._raw.encode_batch([text], add_special_tokens=False)[0]


def _model_directory(path: str) -> str:
    """The local directory of ``path``: itself, or a hub name's snapshot in the local HF cache (where its
    processor files are, next to its tokenizer)."""
    if os.path.isdir(path):
        return path
    try:
        from huggingface_hub import snapshot_download

        return str(snapshot_download(path, local_files_only=True, allow_patterns=["*.json", "*.jinja"]))
    except Exception:  # not in the cache: no processor files to read
        return path
