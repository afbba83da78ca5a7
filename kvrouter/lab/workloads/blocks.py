"""Block content hashes of workload prompts, cached per segment key.

The evaluator hashes every prompt's full blocks exactly as the gateway does (``indexer.hashing``), then
chains them under the request's ``cache_salt``.  Most tokens of a trace repeat the same segments, and a
block lying wholly inside one segment that starts on a block boundary depends only on (segment key,
block index in the segment), so its content hash is computed once per key::

    segments   |  k0 (512)  |  k7 (512)  |  k9 (300)  |
    blocks     |b0 ... b31  |b0 ... b31  |b0..b17|    (16-token blocks; k9's last 12 tokens: no full block)
    cache      k0 -> H[0:32]  k7 -> H[0:32]  k9 -> H[0:18]   (a shorter use of k9 reads a prefix)

When a segment ends off a block boundary, the block that straddles it and everything after it is hashed
from tokens, uncached.  A cached block costs 8 bytes plus per-key overhead; ``warm`` computes many keys
in one vectorized pass and is the fast way to fill the cache.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

from indexer.extra_keys import mixed_request_content
from indexer.hashing import (
    MAX_BLOCK_SIZE,
    I64Array,
    TokenEncodingError,
    base_hash,
    chain,
    content_hashes,
    content_hashes_raw,
)
from kvrouter.lab.workloads.errors import NotMaterialized
from kvrouter.lab.workloads.spec import Request, Segment, TokenSpace
from kvrouter.lab.workloads.tokens import U32Array, segments_tokens, streams_tokens

_EMPTY: I64Array = np.zeros(0, dtype=np.int64)
_WARM_BATCH_TOKENS = 1 << 21  # tokens generated per vectorized pass of ``warm`` (~40 MB of temporaries)


def hash_token_array(tokens: U32Array | npt.NDArray[np.int64], block_size: int) -> I64Array:
    """``indexer.hashing.content_hashes`` of a numpy token array, without building a Python list.

    The indexer reads msgpack; every token is written as a msgpack uint32 (0xCE + 4 bytes big-endian),
    which its parser accepts for any value, so the hashes are the indexer's own."""
    n = len(tokens)
    if n < block_size:
        return _EMPTY
    if tokens.dtype != np.uint32 and (tokens.min() < 0 or tokens.max() >= 1 << 32):
        raise TokenEncodingError("token ids must be ints in 0 .. 2**32-1")
    buf = np.empty(5 + 5 * n, dtype=np.uint8)
    buf[0] = 0xDD  # array32 header
    buf[1:5] = np.frombuffer(n.to_bytes(4, "big"), dtype=np.uint8)
    body = buf[5:].reshape(n, 5)
    body[:, 0] = 0xCE
    body[:, 1:] = np.asarray(tokens, dtype=">u4").view(np.uint8).reshape(n, 4)
    hashes, _ = content_hashes_raw(buf.data, block_size)
    return hashes


def _aligned_walk(segments: Sequence[Segment], block_size: int) -> tuple[list[tuple[int, int]], int, int]:
    """Split a prompt into its cacheable part and its tail.

    Returns ``(pairs, index, skip)``: ``pairs`` are (key, full blocks) for the leading segments that start
    on a block boundary; if a segment ends off a boundary and more segments follow, the tail starts in
    segment ``index`` after ``skip`` tokens (``index == len(segments)`` when there is no tail)."""
    pairs: list[tuple[int, int]] = []
    last = len(segments) - 1
    for i, seg in enumerate(segments):
        full = seg.length // block_size
        pairs.append((seg.key, full))
        if seg.length % block_size and i < last:
            return pairs, i, full * block_size
    return pairs, len(segments), 0


class BlockContentCache:
    """Content hashes (``indexer.hashing`` ``H_k``) of prompts' full blocks, cached per segment key.

    Returned arrays may be read-only views of the cache.  Not thread-safe: one owner (the evaluator's
    loop) uses it."""

    def __init__(self, space: TokenSpace, block_size: int) -> None:
        if not 0 < block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"block size {block_size} outside 1..{MAX_BLOCK_SIZE}")
        self.space = space
        self.block_size = block_size
        self._by_key: dict[int, I64Array] = {}
        self.hits = 0
        """Segment lookups served from the cache."""
        self.misses = 0
        """Segment lookups that had to generate and hash tokens."""

    def __len__(self) -> int:
        return len(self._by_key)

    @property
    def nbytes(self) -> int:
        """Bytes of cached hashes (a view kept from a ``warm`` batch counts its own length only)."""
        return sum(8 * len(v) for v in self._by_key.values())

    def _segment_blocks(self, key: int, blocks: int) -> I64Array:
        cached = self._by_key.get(key)
        if cached is not None and len(cached) >= blocks:
            self.hits += 1
            return cached[:blocks]
        self.misses += 1
        bs = self.block_size
        hashes = hash_token_array(segments_tokens(self.space, (Segment(key, blocks * bs),)), bs)
        hashes.setflags(write=False)
        self._by_key[key] = hashes
        return hashes

    def warm(self, requests: Iterable[Request]) -> None:
        """Hash, in large vectorized batches, every cacheable segment of ``requests`` not cached yet."""
        need: dict[int, int] = {}
        for req in requests:
            if req.token_ids is not None:
                continue
            for key, count in _aligned_walk(req.segments, self.block_size)[0]:
                if count > need.get(key, 0):
                    need[key] = count
        todo = [(k, b) for k, b in need.items() if b and len(self._by_key.get(k, _EMPTY)) < b]
        bs = self.block_size
        start = 0
        while start < len(todo):
            end, tokens = start, 0
            while end < len(todo) and (tokens == 0 or tokens + todo[end][1] * bs <= _WARM_BATCH_TOKENS):
                tokens += todo[end][1] * bs
                end += 1
            batch = todo[start:end]
            keys = np.fromiter((k for k, _ in batch), dtype=np.uint64, count=len(batch))
            blocks = np.fromiter((b for _, b in batch), dtype=np.int64, count=len(batch))
            # Each stream contributes whole blocks, so block boundaries of the concatenation are its own.
            hashes = hash_token_array(streams_tokens(self.space, keys, blocks * bs), bs)
            hashes.setflags(write=False)
            ends = np.cumsum(blocks).tolist()
            for (key, count), stop in zip(batch, ends):
                self._by_key[key] = hashes[stop - count : stop]
            self.misses += len(batch)
            start = end

    def content_hashes(self, request: Request) -> I64Array:
        """``H_k`` of every full block of the prompt (as ``indexer.hashing.content_hashes`` would give)."""
        if request.token_ids is not None:
            return content_hashes(request.token_ids, self.block_size)
        if not request.segments:
            if request.num_prompt_tokens:
                raise NotMaterialized(f"request {request.id} has text only; materialize it first")
            return _EMPTY
        return self.segments_hashes(request.segments)

    def segments_hashes(self, segments: Sequence[Segment]) -> I64Array:
        """``H_k`` of every full block of the concatenated segments."""
        pairs, index, skip = _aligned_walk(segments, self.block_size)
        parts = [self._segment_blocks(key, blocks) for key, blocks in pairs if blocks]
        if index < len(segments):
            tail = segments_tokens(self.space, segments[index:], skip=skip)
            parts.append(hash_token_array(tail, self.block_size))
        if not parts:
            return _EMPTY
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def chain_hashes(self, request: Request, base: int | None = None) -> I64Array:
        """Chain hashes (``indexer`` ``ChainHash`` values) of the prompt's full blocks.

        ``base`` defaults to the namespace of the request's ``cache_salt`` (no LoRA).  A prompt's
        multimodal items are mixed into the blocks they overlap, as the index mixes an event's extra keys
        and the gateway a live request's (``indexer.extra_keys``)."""
        if base is None:
            base = base_hash(None, request.cache_salt)
        content = self.content_hashes(request)
        if request.items:
            content = mixed_request_content(content, request.items, self.block_size)
        return chain(content, base)
