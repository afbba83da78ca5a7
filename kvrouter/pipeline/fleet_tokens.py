"""The gateway's token source: the tokenizer cache, one tokenizer per served model (an adapter: its base's).

Responses and Messages requests are rendered the way vLLM's own Responses and Messages paths render them
(``CachedTokenizer.aencode_responses_request`` / ``aencode_messages_request``: their conversion, their
template arguments and tokenization; what vLLM refuses is routed without ids).  Chat requests are
rendered with the model's chat template exactly as vLLM renders them (the whole body: ``tokenizer_cache``'s
``aencode_chat_request``, see docs/parity.md); completions text (and a pooling request's text input) is
tokenized with special tokens; token-id prompts pass through.  Long tokenizations run on the tokenizer
cache's thread pool, off the event loop.  A template error is the client's: a 400 with the reason.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import msgspec

from indexer.hashing import TokenIds, id_list
from indexer.service import LookupRequest, PromptError
from tokenizer_cache import (
    ChatTemplateError,
    InvalidPromptError,
    Loader,
    NoChatTemplateError,
    TokenizerCacheError,
    TokenizerRegistry,
    UnsupportedContentError,
)
from tokenizer_cache.agent_inputs import AgentInputError

from ..api.errors import ApiError, BadRequest
from ..api.requests import Kind, ParsedRequest, parse_body
from ..config import RouterFleetConfig

log = logging.getLogger("kvrouter.gateway")


class FleetTokens:
    """``TokenSource`` over a ``TokenizerRegistry``; models without a tokenizer are routed untokenized."""

    def __init__(self, registry: TokenizerRegistry | None) -> None:
        self.registry = registry
        self.untokenized: Counter[str] = Counter()
        """Chat requests routed without token ids because no chat template is configured, by model."""

    @classmethod
    def from_config(cls, cfg: RouterFleetConfig, *, loader: Loader | None = None) -> FleetTokens:
        """The fleet file's tokenizers (``loader``: how each is built; default: from its files)."""
        raw = msgspec.to_builtins(cfg)
        if not raw.get("tokenizer") and not any(m.get("tokenizer") for m in raw.get("models", {}).values()):
            return cls(None)
        return cls(TokenizerRegistry.from_fleet(raw, loader=loader))

    async def tokens(self, req: ParsedRequest) -> TokenIds | None:
        """The request's token ids: chat and completions as vLLM renders them; a Responses or Messages
        request as vLLM's own Responses / Messages path renders it; a pooling request's single text input.
        None when they cannot be known here (no tokenizer, media content, a request vLLM refuses on those
        routes, a continued Responses conversation whose history only its instance holds, other routes)."""
        if req.kind in ("completions", "chat") and isinstance(req.prompt, list):
            return req.prompt
        if self.registry is None or req.kind == "other":
            return None
        if req.kind == "responses" and req.previous_response_id is not None and req.history is None:
            return None  # its history is held by its instance only (this router did not see it answered)
        try:
            tok = self.registry.get(req.base_model or req.model)
        except TokenizerCacheError:
            return None  # this model has no tokenizer: route it by load and prefix text
        b = req.body
        try:
            if req.kind == "responses":
                h = req.history
                enc = await tok.aencode_responses_request(
                    b,
                    previous_messages=None if h is None else h.messages,
                    previous_output=None if h is None else h.output,
                )
            elif req.kind in ("messages", "count_tokens"):
                enc = await tok.aencode_messages_request(b, count_tokens=req.kind == "count_tokens")
            elif req.kind == "chat":
                enc = await tok.aencode_chat_request(b)  # every field vLLM reads, as vLLM reads it
            elif isinstance(req.prompt, str):
                enc = await tok.aencode_prompt_ex(
                    req.prompt, add_special_tokens=b.get("add_special_tokens", True) is not False
                )
            else:
                return None
            req.reused_tokens = enc.reused_tokens
            if (
                enc.media_paths
            ):  # a multimodal prompt: its items key its blocks (exact up to the first unknown)
                req.mm_items, req.media_paths = tuple(enc.mm), enc.media_paths
            # The array when the cache had it at hand (a reused prefix): hashing it skips converting
            # thousands of Python ints, the largest part of hashing a long prompt.
            return enc.tokens if enc.array is None else enc.array
        except AgentInputError:
            return None  # vLLM answers it (a 400): routed without ids, never refused here
        except UnsupportedContentError as e:
            req.untokenized = e.reason  # media or options not reproduced: routed by load, counted
            return None
        except NoChatTemplateError:
            # vLLM may have a template of its own (--chat-template): route by load and prefix text rather
            # than refuse; say so once per model, since every chat request of that model will miss.
            model = req.model or ""
            self.untokenized[model] += 1
            if self.untokenized[model] == 1:
                log.warning(
                    "no chat template for this model: chat requests are routed without token ids "
                    "(set chat_template in the fleet file)",
                    extra={"model": req.model},
                )
            return None
        except (ChatTemplateError, InvalidPromptError) as e:
            raise BadRequest(str(e)) from None

    async def encode_lookup(self, req: LookupRequest) -> list[int]:
        """The cache-hit API's ``prompt`` / ``messages`` (``indexer.service.PromptEncoder``)."""
        body: dict[str, Any] = {"model": req.model}
        if req.messages is not None:
            body.update(
                messages=req.messages,
                tools=req.tools,
                chat_template_kwargs=req.chat_template_kwargs,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
            )
            kind: Kind = "chat"
        else:
            body["prompt"] = req.prompt
            kind = "completions"
        try:
            parsed = parse_body(msgspec.json.encode(body), kind)
            got = await self.tokens(parsed)
        except ApiError as e:
            raise PromptError(e.message, e.status) from None
        if got is None:
            raise PromptError(
                f"cannot tokenize for model {req.model!r} (no tokenizer or chat template): send token_ids"
            )
        return id_list(got)

    async def warm(self, models: list[str | None]) -> None:
        """Load the tokenizers now (off the event loop), so the first requests do not wait for a load."""
        if self.registry is None:
            return
        import asyncio

        loop = asyncio.get_running_loop()
        for m in models:
            try:
                await loop.run_in_executor(None, self.registry.get, m)
            except TokenizerCacheError:
                continue

    def close(self) -> None:
        if self.registry is not None:
            self.registry.close()
