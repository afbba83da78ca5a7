"""Deterministic synthetic token streams.

Every segment key names an endless stream of token ids; position ``i`` of stream ``k`` is a pure function
of ``(k, i)`` and the ``TokenSpace``::

    x     = k + (i + 1) * G                  (mod 2**64; G odd, so positions never repeat within a stream)
    z     = splitmix64_finaliser(x)
    r     = ((z >> 32) * n_allowed) >> 32    uniform in [0, n_allowed) without a division
    token = r-th id of [low, vocab_size) that is not excluded

Hence: equal keys give equal tokens; a stream used with two lengths agrees on the shorter one's tokens (the
partial tail of a Mooncake block is the full block's prefix); different keys differ at almost every
position (two streams would coincide only if their keys differed by ``j * G`` for some |j| < length).
Everything is vectorized numpy on uint64 (array arithmetic wraps silently; scalar arithmetic would warn,
so scalars are always lifted into arrays first).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec
import numpy as np
import numpy.typing as npt

from kvrouter.lab.workloads.errors import NotMaterialized
from kvrouter.lab.workloads.spec import Request, Segment, TokenSpace

U64Array = npt.NDArray[np.uint64]
U32Array = npt.NDArray[np.uint32]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_MASK64 = (1 << 64) - 1


def mix64(x: U64Array) -> U64Array:
    """splitmix64's finaliser, elementwise: a bijection of uint64 with good avalanche."""
    z = (x ^ (x >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def derive_key(seed: int, *labels: str | int) -> int:
    """A stream key for what ``labels`` name (e.g. ``("sglang-gsp", "system", 3)``) under ``seed``.

    Stable across processes and platforms (blake2b of the msgpack encoding)."""
    data = msgspec.msgpack.encode([seed, list(labels)])
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def derive_keys(namespace: int, ids: npt.NDArray[np.int64]) -> U64Array:
    """Keys for many integer ids at once (a trace's hash ids): ``mix64(namespace + (id + 1) * G)``."""
    ns = np.full(1, namespace & _MASK64, dtype=np.uint64)
    return mix64(ns + (ids.astype(np.uint64) + np.uint64(1)) * _GOLDEN)


def _allowed(space: TokenSpace) -> tuple[int, npt.NDArray[np.uint32]]:
    excluded = np.unique(np.asarray([e for e in space.excluded if space.low <= e < space.vocab_size]))
    n = space.vocab_size - space.low - len(excluded)
    if n <= 0:
        raise ValueError(f"token space {space} allows no id")
    return n, excluded.astype(np.uint32)


def _to_ids(z: U64Array, space: TokenSpace) -> U32Array:
    n, excluded = _allowed(space)
    r = ((z >> np.uint64(32)) * np.uint64(n)) >> np.uint64(32)
    ids = r.astype(np.uint32) + np.uint32(space.low)
    # Excluded ids ascending: each shift moves an id past one excluded id, so the r-th allowed id results.
    for e in excluded:
        ids += ids >= e
    return ids


def stream_tokens(space: TokenSpace, key: int, length: int, start: int = 0) -> U32Array:
    """Positions ``start .. start + length`` of stream ``key``."""
    k = np.full(1, key & _MASK64, dtype=np.uint64)
    pos = np.arange(start + 1, start + length + 1, dtype=np.uint64)
    return _to_ids(mix64(k + pos * _GOLDEN), space)


def streams_tokens(
    space: TokenSpace,
    keys: npt.NDArray[np.uint64],
    lengths: npt.NDArray[np.int64],
    starts: npt.NDArray[np.int64] | None = None,
) -> U32Array:
    """The concatenation, over ``j``, of positions ``starts[j] .. starts[j] + lengths[j]`` of stream
    ``keys[j]``; one vectorized pass whatever the number of streams."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.uint32)
    begin = np.cumsum(lengths) - lengths
    # Position within its own stream of every output token (1-based, as in stream_tokens).
    pos = np.arange(1, total + 1, dtype=np.int64) - np.repeat(begin, lengths)
    if starts is not None:
        pos += np.repeat(np.asarray(starts, dtype=np.int64), lengths)
    x = np.repeat(np.asarray(keys, dtype=np.uint64), lengths) + pos.astype(np.uint64) * _GOLDEN
    return _to_ids(mix64(x), space)


def segments_tokens(space: TokenSpace, segments: Sequence[Segment], skip: int = 0) -> U32Array:
    """Tokens of the concatenated segments, leaving out the first ``skip`` tokens of the first one."""
    if not segments:
        return np.zeros(0, dtype=np.uint32)
    keys = np.fromiter((s.key for s in segments), dtype=np.uint64, count=len(segments))
    lengths = np.fromiter((s.length for s in segments), dtype=np.int64, count=len(segments))
    starts = np.zeros(len(segments), dtype=np.int64)
    if skip:
        if not 0 <= skip <= lengths[0]:
            raise ValueError(f"skip {skip} outside the first segment (length {lengths[0]})")
        starts[0] = skip
        lengths[0] -= skip
    return streams_tokens(space, keys, lengths, starts)


def prompt_tokens(request: Request, space: TokenSpace) -> npt.NDArray[np.int64] | U32Array:
    """The prompt's token ids as an array.  Raises ``NotMaterialized`` for text-only requests."""
    if request.token_ids is not None:
        return np.asarray(request.token_ids, dtype=np.int64)
    if request.segments or request.num_prompt_tokens == 0:
        return segments_tokens(space, request.segments)
    raise NotMaterialized(f"request {request.id} has text only; materialize the workload with a tokenizer")


def prompt_ids(request: Request, space: TokenSpace) -> list[int]:
    """The prompt's token ids as a list (for ``/v1/completions`` with ``prompt: [ids]``)."""
    if request.token_ids is not None:
        return request.token_ids
    ids: list[int] = prompt_tokens(request, space).tolist()
    return ids


def output_tokens(request: Request, space: TokenSpace) -> U32Array:
    """The tokens a simulated engine should generate (empty when the workload does not care)."""
    return segments_tokens(space, request.output_segments)
