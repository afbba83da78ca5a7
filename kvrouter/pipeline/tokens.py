"""From a parsed request to the token ids vLLM will compute: the seam the request path tokenizes through.

Token-id prompts pass through.  Text prompts and chat messages go through the model's tokenizer (the
tokenizer cache: chat template rendered exactly as vLLM does, long repeated prefixes not re-tokenized), run
off the event loop.  A model without a tokenizer is routed without block hashes (by load and prefix text).
"""

from __future__ import annotations

from typing import Protocol

from indexer.hashing import TokenIds

from ..api.requests import ParsedRequest


class TokenSource(Protocol):
    """Tokenizes a request as vLLM would; returns None when no tokenizer serves the model."""

    async def tokens(self, req: ParsedRequest) -> TokenIds | None:
        """A list, or a uint32 array when the tokenizer cache had one at hand (hashed without conversion)."""

    async def warm(self, models: list[str | None]) -> None:
        """Load what the first requests would otherwise wait for."""


class PassThroughTokens:
    """Only token-id prompts (no tokenizer configured)."""

    async def warm(self, models: list[str | None]) -> None:
        return None

    async def tokens(self, req: ParsedRequest) -> TokenIds | None:
        return req.prompt if isinstance(req.prompt, list) else None
