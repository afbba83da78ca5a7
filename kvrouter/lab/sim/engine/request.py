"""One request inside the engine model: its tokens, its block hashes, its progress.

::

    tokens:         | prompt ........................ | out0 out1 ... |
                      prompt_token_ids (kept as given)   _outputs[:num_output_tokens]
    block_hashes:   | h0 | h1 | ... full blocks only, extended as generated tokens fill blocks
    num_computed:   tokens whose KV exists (cache hits count as computed)   <= num_tokens

vLLM's rule, kept here: a token is sampled in a step after which ``num_computed == num_tokens``; the last
sampled token is never fed back, so a request that ends holds KV for ``prompt + outputs - 1`` tokens.
Output tokens are given by the caller (a trace whose next turn quotes this answer) or pseudo-random but fixed
by the request's seed (the evaluator replays runs exactly).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import numpy as np

from indexer.extra_keys import block_mm_keys
from indexer.hashing import TokenIds, id_list
from kvrouter.lab.sim.engine.encoder import EncoderWindow
from kvrouter.lab.sim.engine.hashing import block_extra_keys, chain_hashes, chain_hashes_keyed, extra_digest
from kvrouter.lab.sim.engine.types import BlockHash
from kvrouter.types import RequestId


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue after losing its blocks
    LOADING = "loading"  # blocks allocated, its prompt's KV cache arriving from a prefill instance
    FINISHED = "finished"


class Request:
    """Mutable engine-side state of one request.  Built by ``Engine.add_request``; callers never mutate it.

    ``num_tokens`` (prompt + outputs so far) and ``num_output_tokens`` are plain attributes kept in step by
    ``append_output_token(s)``, the only place tokens are added (they are read per request per step).
    The prompt is kept as given, a list or the evaluator's integer array, and never copied whole: most
    runs only hash it; ``token_slice`` reads tokens back."""

    __slots__ = (
        "_extra0",
        "_extra_rest",
        "_mm",
        "_none_hash",
        "_outputs",
        "block_hashes",
        "block_size",
        "cache_salt",
        "cpu_loaded_tokens",
        "encoder",
        "hold",
        "loaded",
        "lora_id",
        "lora_name",
        "max_tokens",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_output_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "num_tokens",
        "prompt_token_ids",
        "remote_tokens",
        "request_id",
        "seed",
        "shared_loaded_tokens",
        "status",
        "vocab_size",
    )

    def __init__(
        self,
        request_id: RequestId,
        prompt_token_ids: TokenIds,
        max_tokens: int,
        *,
        block_size: int,
        none_hash: int,
        seed: int,
        vocab_size: int,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        lora_id: int | None = None,
        hash_blocks: bool = True,
        output_token_ids: list[int] | None = None,
        hold: bool = False,
        remote_tokens: int | None = None,
        mm_items: Sequence[tuple[str, int, int]] = (),
    ) -> None:
        """``mm_items``: the prompt's multimodal items ``(identifier, offset, length)``, keyed into its blocks
        as vLLM keys them (``indexer.extra_keys.block_mm_keys``)."""
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.num_prompt_tokens = self.num_tokens = len(prompt_token_ids)
        self.num_output_tokens = 0
        self.max_tokens = max_tokens
        self.block_size = block_size
        self.cache_salt = cache_salt or None
        self.lora_name = lora_name
        self.lora_id = lora_id
        self.seed = seed
        self.vocab_size = vocab_size
        self.status = Status.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # set once, at first scheduling (vLLM's ``num_cached_tokens``)
        self.cpu_loaded_tokens = 0  # of those, loaded from the CPU tier ...
        self.shared_loaded_tokens = 0  # ... and from a shared store
        self.num_preemptions = 0
        self.hold = hold
        """A prefill leg: when finished, its blocks stay allocated until released (a decode instance
        pulls them; vLLM's NIXL connector delays freeing them, under a lease)."""
        self.remote_tokens = remote_tokens
        """A decode leg: prompt tokens a prefill instance holds for it (None: none, or already asked for)."""
        self.loaded = False
        """Its transfer ended (landed or failed): it waits with its blocks and computed tokens set."""
        self._none_hash = none_hash
        self._extra0 = extra_digest(block_extra_keys(lora_name, self.cache_salt, 0))
        self._extra_rest = extra_digest(block_extra_keys(lora_name, None, 1))
        self._outputs: list[int] | None = None
        if output_token_ids is not None:
            self._outputs = output_token_ids[:max_tokens]
            if len(self._outputs) < max_tokens:
                self._outputs += self._draw(max_tokens - len(self._outputs))
        self.encoder = EncoderWindow(mm_items) if mm_items else None
        """Its multimodal items' encoder inputs, scheduled as its prefill reaches them."""
        self._mm: list[tuple[tuple[str, int], ...]] = (
            block_mm_keys(mm_items, len(prompt_token_ids) // block_size, block_size) if mm_items else []
        )
        # Prompt blocks are hashed once, here, like vLLM's Request (the hashes survive preemption).
        self.block_hashes: list[BlockHash] = []
        if hash_blocks and self._mm:
            self.block_hashes = chain_hashes_keyed(
                prompt_token_ids,
                block_size,
                parent=none_hash,
                extras=[extra_digest(k) for k in self.extra_keys(0, len(self._mm))],
            )
        elif hash_blocks:
            self.block_hashes = chain_hashes(
                prompt_token_ids,
                block_size,
                parent=none_hash,
                first_extra=self._extra0,
                rest_extra=self._extra_rest,
            )

    def ensure_hashes(self, num_blocks: int) -> None:
        """Hash full blocks up to ``num_blocks`` (blocks completed by generated tokens)."""
        have = len(self.block_hashes)
        if num_blocks <= have:
            return
        parent = self.block_hashes[-1] if have else self._none_hash
        first = self._extra0 if have == 0 else self._extra_rest
        bs = self.block_size
        self.block_hashes.extend(
            chain_hashes(
                self.token_slice(have * bs, num_blocks * bs),
                bs,
                parent=parent,
                first_extra=first,
                rest_extra=self._extra_rest,
            )
        )

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens ``start .. stop`` (prompt then outputs) as a new list; ``stop`` <= ``num_tokens``."""
        p = self.num_prompt_tokens
        out: list[int] = []
        if start < p:
            part = self.prompt_token_ids[start : min(stop, p)]
            out = id_list(part)
        if stop > p:
            assert self._outputs is not None
            out += self._outputs[max(start, p) - p : stop - p]
        return out

    def extra_keys(self, start_block: int, end_block: int) -> list[tuple[str, ...] | None]:
        """The ``extra_keys`` list of a BlockStored event for blocks ``start_block .. end_block``."""
        if self.lora_name is None and self.cache_salt is None and not self._mm:
            return [None] * (end_block - start_block)
        mm = self._mm
        return [
            block_extra_keys(self.lora_name, self.cache_salt, i, mm[i] if i < len(mm) else ())
            for i in range(start_block, end_block)
        ]

    def _draw(self, n: int) -> list[int]:
        drawn: list[int] = np.random.default_rng(self.seed).integers(0, self.vocab_size, size=n).tolist()
        return drawn

    def append_output_token(self) -> int:
        """Sample the next output token: the given ones first, then pseudo-random for the request's seed."""
        if self._outputs is None:
            self._outputs = self._draw(self.max_tokens)
        tok = self._outputs[self.num_output_tokens]
        self.num_output_tokens += 1
        self.num_tokens += 1
        return tok

    def append_output_tokens(self, n: int) -> list[int]:
        """``n`` calls of ``append_output_token`` at once (the evaluator's coalesced decode steps)."""
        if self._outputs is None:
            self._outputs = self._draw(self.max_tokens)
        i = self.num_output_tokens
        toks = self._outputs[i : i + n]
        assert len(toks) == n, "more output tokens than max_tokens"
        self.num_output_tokens += n
        self.num_tokens += n
        return toks
