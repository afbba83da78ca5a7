"""What the simulated model says: seeded answers made of real whole-word tokens, and their text.

``AnswerVocab`` keeps the ids of tokens that are one lowercase word with a leading space (" the",
" cache", ...), lowest ids first; ``plan()`` draws a request's n word ids (+ EOS when it ends naturally)
from its seed, and ``piece(id)`` gives each one's text from a table.

Why whole words: the text of an answer is exactly the decoding of its ids, and re-tokenizing it gives
the same ids back, so a next chat turn that quotes the answer reuses the KV blocks the answer filled
during decode, as it does with a real model most of the time.

When an answer ends: with ``answer_tokens`` = m > 0, a request without ``ignore_eos`` ends after a seeded
length drawn uniformly from [m/2, 3m/2] (finish_reason ``stop``, EOS counted in ``completion_tokens`` and
absent from the text, as vLLM reports it); a smaller ``max_tokens`` ends it by length, so
``max_tokens`` <= m/2 always yields exactly ``max_tokens``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from kvrouter.lab.sim.errors import SimConfigError
from tokenizer_cache import CachedTokenizer

_WORD = re.compile(r"^[Ġ▁][a-z]{2,12}$")
"""A byte-level BPE (``Ġ``) or SentencePiece (``▁``) token spelling one lowercase word after a space."""


class AnswerPlan(NamedTuple):
    token_ids: list[int]
    """Every token the engine will generate, EOS included when ``stops``."""
    stops: bool
    """The answer ends with EOS before ``max_tokens`` (finish_reason ``stop``)."""


class AnswerVocab:
    """The words a simulated model answers with.  Immutable after construction; shared by instances."""

    def __init__(self, word_ids: Sequence[int], pieces: dict[int, str], eos_id: int | None) -> None:
        if not word_ids:
            raise SimConfigError("the answer vocabulary is empty")
        self.word_ids = np.asarray(word_ids, dtype=np.int64)
        self.pieces = dict(pieces)
        self.eos_id = eos_id
        if eos_id is not None:
            self.pieces[eos_id] = ""  # special tokens are skipped in the text (skip_special_tokens)

    @classmethod
    def from_tokenizer(cls, tok: CachedTokenizer, max_words: int = 4096) -> AnswerVocab:
        """Up to ``max_words`` whole-word tokens of ``tok`` (lowest ids: the most frequent merges)."""
        raw = tok.hf_tokenizer.backend_tokenizer
        vocab = raw.get_vocab(with_added_tokens=False)
        candidates = sorted(i for s, i in vocab.items() if _WORD.match(s))
        pieces: dict[int, str] = {}
        spelled = {i: s for s, i in vocab.items()}
        for i in candidates:
            text = raw.decode([i])
            if spelled[i][0] == "▁" and not text.startswith(" "):
                text = " " + text  # SentencePiece decoders drop a lone token's leading space; streams keep it
            if text.startswith(" ") and text[1:].isalpha():
                pieces[i] = text
                if len(pieces) >= max_words:
                    break
        if len(pieces) < 16:
            raise SimConfigError(f"tokenizer {tok.name_or_path!r} has too few whole-word tokens to answer")
        eos = getattr(tok.hf_tokenizer, "eos_token_id", None)
        return cls(list(pieces), pieces, eos if isinstance(eos, int) else None)

    def plan(self, seed: int, max_tokens: int, *, answer_tokens: int, ignore_eos: bool) -> AnswerPlan:
        """The answer of a request with this seed (deterministic)."""
        rng = np.random.default_rng(seed & 0xFFFF_FFFF_FFFF_FFFF)
        n = max_tokens
        stops = False
        if answer_tokens > 0 and not ignore_eos and self.eos_id is not None:
            natural = int(rng.integers(max(1, answer_tokens // 2), answer_tokens * 3 // 2 + 1))
            if natural < max_tokens:
                n, stops = natural, True
        ids: list[int] = self.word_ids[rng.integers(0, len(self.word_ids), size=n)].tolist()
        if stops:
            assert self.eos_id is not None
            ids[-1] = self.eos_id
        return AnswerPlan(ids, stops)

    def piece(self, token_id: int) -> str:
        """Text of one generated token (empty for EOS)."""
        return self.pieces.get(token_id, "")

    def text(self, token_ids: Sequence[int]) -> str:
        get = self.pieces.get
        return "".join(get(t, "") for t in token_ids)
