"""The prefix cache's own work: find the longest cached prefix of a text, splice its tokens onto a new
tokenization of the rest, and cache the result (``PrefixIndex``; why a splice is exact: ``seams``).

``SpliceCache.content(text)`` is written as steps: it yields each text it needs tokenized and is resumed
with that text's ``tokenizers.Encoding``, so its caller (``CachedTokenizer``) decides where tokenization
runs (this thread, the event loop, a pool); nothing here tokenizes.

Invariants: a spliced result is used only when ``verify_splice`` accepts it, else the text is tokenized
in full (a counted fallback), so every answer equals a full tokenization; the index serialises its own
state and the counters change under one lock, so the cache is thread-safe.
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Generator
from typing import Any, TypeVar

import numpy as np

from .config import CacheConfig
from .prefix_index import Entry, Ids, LazySeams, Match, PrefixIndex, U32Array, head_list, ids_array, spliced
from .seams import AddedTokenMargin, Splice, plan_splice, sample_seams, verify_splice

_T = TypeVar("_T")
Steps = Generator[str, Any, _T]
"""A computation that yields each text it needs tokenized, is sent its Encoding, and returns a result."""

# What a tokenizers.Encoding holds per token (ids, type ids, token strings, offsets, word ids, masks),
# counted while an entry keeps one for its lazy seams (docs/measurements.md, "Tokenizer cache").
_ENCODING_BYTES_PER_TOKEN = 128


class IdsOnly(str):
    """A text to tokenize whose token ids alone are read (not cached: no seams, no offsets)."""

    __slots__ = ()


class _Counters:
    """Mutable counters, only touched under ``SpliceCache._lock``."""

    __slots__ = ("exact_hits", "fallbacks", "hits", "lookups", "misses", "tokens_encoded", "tokens_reused")

    def __init__(self) -> None:
        self.lookups = self.hits = self.exact_hits = self.misses = self.fallbacks = 0
        self.tokens_reused = self.tokens_encoded = 0


class SpliceCache:
    """One tokenizer's prefix cache: its index, its counters, and the splice (see the module docstring)."""

    def __init__(
        self, config: CacheConfig, *, reuse: bool, added_margin: AddedTokenMargin, prefer_space: bool
    ) -> None:
        """``reuse``: the tokenizer's pipeline admits splicing (``seams.reuse_blockers``) and the cache has
        room; otherwise every text is tokenized in full.  ``added_margin`` and ``prefer_space``: what the
        pipeline needs of a seam (``seams.AddedTokenMargin``, ``seams.start_sensitive``)."""
        self.config = config
        self.reuse = reuse
        # (R) needs a margin; more of it when an added token may start just before the shared end.
        self._added_margin = added_margin
        self._prefer_space = prefer_space
        self.index = PrefixIndex(chunk_chars=config.chunk_chars, max_bytes=config.max_cache_bytes)
        self._lock = threading.Lock()
        self._n = _Counters()

    def count(self, **deltas: int) -> None:
        with self._lock:
            n = self._n
            for k, v in deltas.items():
                setattr(n, k, getattr(n, k) + v)

    def counts(self) -> dict[str, int]:
        """The counters, read at one instant."""
        with self._lock:
            return {k: getattr(self._n, k) for k in _Counters.__slots__}

    def content(self, text: str) -> Steps[tuple[list[int], int, U32Array | None]]:
        """Content tokens of ``text`` (no special tokens added), how many came from the cache, and the
        same tokens as an array when they were at hand, as steps: each yielded text is to be tokenized
        (an ``IdsOnly`` one without offsets), and its ``tokenizers.Encoding`` sent back."""
        index = self.index
        if not self.reuse or len(text) < index.chunk_chars:
            ids = (yield IdsOnly(text)).ids
            self.count(tokens_encoded=len(ids))
            return ids, 0, None
        digests = index.chunk_digests(text)
        match = index.lookup(text, digests)
        outcome = "misses" if match is None else (yield from self._splice(text, match, digests))
        if not isinstance(outcome, str):
            return outcome
        # Miss or fallback: full encode, then cache the text.
        enc = yield text
        ids = enc.ids
        pos, idx = array("i"), array("i")
        sample_seams(
            enc,
            len(ids),
            stride=self.config.seam_stride_tokens,
            tail_tokens=self.config.seam_tail_tokens,
            tail_stride=self.config.seam_tail_stride_tokens,
            first_token=0,
            min_rel_pos=0,
            pos_offset=0,
            idx_offset=0,
            out_pos=pos,
            out_idx=idx,
        )
        known = match.shared_chunks if match is not None else 0
        arr = ids_array(ids)
        index.insert(
            text, tuple(ids), (pos, idx), index.entry_digests(text, digests), known_keys=known, arr=arr
        )
        self.count(lookups=1, tokens_encoded=len(ids), **{outcome: 1})
        return ids, 0, arr

    def _splice(self, text: str, match: Match, digests: str) -> Steps[tuple[list[int], int, U32Array] | str]:
        """Reuse ``match.entry``'s tokens for ``text``; else name the counter to bump ("misses"...)."""
        entry = match.entry
        m = match.common
        n_cached = len(entry.ids)
        if m == len(text) == len(entry.text):
            self.count(lookups=1, hits=1, exact_hits=1, tokens_reused=n_cached)
            return head_list(entry.ids, n_cached), n_cached, entry.arr
        seam_pos, seam_idx = entry.seams()
        plan = plan_splice(
            seam_pos,
            seam_idx,
            m,
            text,
            margin=self.config.margin_chars + self._added_margin.extra(text, m),
            overlap=self.config.overlap_chars,
            prefer_space=self._prefer_space,
        )
        if plan is None:
            return "misses"
        enc = yield text[plan.pos_b0 :]
        new = enc.ids  # each access converts the whole list: read it once
        if not verify_splice(enc, new, entry.ids, plan):
            return "fallbacks"
        tail = new[plan.idx_b - plan.idx_b0 :]
        out = head_list(entry.ids, plan.idx_b)
        out += tail
        arr = np.concatenate((entry.arr[: plan.idx_b], ids_array(tail)))
        self.count(lookups=1, hits=1, tokens_reused=plan.idx_b, tokens_encoded=len(new))
        # (a text within the entry's is covered by it; one a short tail past the shared prefix is not worth
        # an entry: ``CacheConfig.min_new_chars``)
        if len(text) > m and len(text) - m >= max(1, self.config.min_new_chars):
            ids = spliced(entry.ids, plan.idx_b, tail)
            self._cache_spliced(text, entry, m, plan, enc, len(new), ids, arr, digests, match.shared_chunks)
        return out, plan.idx_b, arr

    def _cache_spliced(
        self,
        text: str,
        entry: Entry,
        m: int,
        plan: Splice,
        enc: Any,
        n_new: int,
        ids: Ids,
        arr: U32Array,
        digests: str,
        shared_chunks: int,
    ) -> None:
        """Cache the query: the entry's seams up to b are valid for it (same words), then G's, sampled
        when the new entry is first spliced from (``LazySeams``: it keeps ``enc`` until then)."""
        seams = _SplicedSeams(entry, plan, enc, n_new, self.config)
        supersedes = entry if m == len(entry.text) else None
        entry_digests = self.index.entry_digests(text, digests)
        self.index.insert(
            text, ids, seams, entry_digests, known_keys=shared_chunks, supersedes=supersedes, arr=arr
        )


class _SplicedSeams(LazySeams):
    """A spliced entry's seams: its base entry's up to b (same words there), then those of the new part
    ``enc`` = f(T[b':]) past b, sampled on first use.  It holds the base's seam arrays (already built:
    planning the splice read them), not the base entry, which stays free to be evicted."""

    __slots__ = ("base_idx", "base_pos", "cfg", "enc", "n_new", "plan")

    def __init__(self, base: Entry, plan: Splice, enc: Any, n_new: int, cfg: CacheConfig) -> None:
        self.base_pos, self.base_idx = base.seams()
        super().__init__(len(self.base_pos) + n_new, _ENCODING_BYTES_PER_TOKEN * n_new)
        self.plan, self.enc, self.n_new, self.cfg = plan, enc, n_new, cfg

    def make(self) -> tuple[array[int], array[int]]:
        plan, cfg, keep = self.plan, self.cfg, self.plan.seam_index + 1
        pos, idx = self.base_pos[:keep], self.base_idx[:keep]
        sample_seams(
            self.enc,
            self.n_new,
            stride=cfg.seam_stride_tokens,
            tail_tokens=cfg.seam_tail_tokens,
            tail_stride=cfg.seam_tail_stride_tokens,
            first_token=plan.idx_b - plan.idx_b0,
            min_rel_pos=plan.pos_b - plan.pos_b0,
            pos_offset=plan.pos_b0,
            idx_offset=plan.idx_b0,
            out_pos=pos,
            out_idx=idx,
        )
        return pos, idx
