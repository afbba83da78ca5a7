"""kvrouter's own chained block hash.

vLLM's block hashes depend on its algorithm, seed and release, so an external router cannot reproduce
them.  Requests and events meet on a hash of our own, from token ids and the keys that change vLLM's
cache key (LoRA name, ``cache_salt``)::

    H_k = NH(tokens of block k)                     a 64-bit hash of the block's token values (ids < 2**32)
    c_0 = P * base + H_0                            base = stable hash of (LoRA name, cache_salt)
    c_k = P * c_{k-1} + H_k          (mod 2**64)    so c_k depends on every token before it

Both sides reach token values through msgpack (events carry ``token_ids`` raw; a request's list is
encoded with msgspec), and one compiled pass reads the ints and hashes the blocks, so ingest never
allocates a Python int per token.  Only full blocks are hashed, as in vLLM.  ``base`` keeps tenants and
adapters apart; the content hashes ``H_k`` do not depend on it, so callers may cache them per prompt
prefix and chain them under any base later.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
from numba import njit

from .types import ChainHash

HASH_VERSION = 1
"""Bumped whenever chain values change; snapshots and shared stores record it."""

I64Array = npt.NDArray[np.int64]

_P = 0x9E3779B97F4A7C15  # odd: invertible mod 2**64
_MASK = (1 << 64) - 1
_EMPTY_I64: I64Array = np.zeros(0, dtype=np.int64)
_ENCODE = msgspec.msgpack.Encoder().encode


class TokenEncodingError(ValueError):
    """Token ids that are not non-negative ints below 2**64 (as msgpack uints)."""


def to_i64(u: int) -> int:
    u &= _MASK
    return u - (1 << 64) if u >> 63 else u


def base_hash(lora_name: str | None = None, cache_salt: str | None = None, extra: Sequence[Any] = ()) -> int:
    """The chain's starting value for a (LoRA, salt, other keys) namespace.  Stable across processes."""
    if lora_name is None and cache_salt is None and not extra:
        return 0
    data = msgspec.msgpack.encode([HASH_VERSION, lora_name, cache_salt, list(extra)])
    return to_i64(int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little"))


def stable_key_hash(key: Any) -> int:
    """A process-independent hash of an extra-keys tuple (multimodal ids and the like)."""
    data = msgspec.msgpack.encode(key)
    return to_i64(int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little"))


MAX_BLOCK_SIZE = 1024


def _nh_keys(n: int) -> npt.NDArray[np.uint64]:
    """Odd multipliers for the NH block hash: a splitmix64 sequence, a constant table never mutated."""
    out = np.empty(n, dtype=np.uint64)
    x = 0x243F6A8885A308D3
    for i in range(n):
        x = (x + 0x9E3779B97F4A7C15) & _MASK
        z = x
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        out[i] = (z ^ (z >> 31)) | 1
    out.setflags(write=False)
    return out


_K = _nh_keys(MAX_BLOCK_SIZE + 2)


@njit(cache=True, nogil=True, boundscheck=False)
def _parse_blocks(buf: Any, pos: int, block_size: int, max_blocks: int, out: Any) -> tuple[int, int]:
    """Read msgpack uints from ``buf[pos:]`` and hash them in blocks.  Returns (full blocks, end position);
    blocks = -1 on a byte that is not a msgpack uint below 2**32 or on a truncated int.

    Block hash: NH over token pairs, ``sum (v[2i] + K[2i]) * (v[2i+1] + K[2i+1])`` (independent multiplies,
    so it runs at the speed of the msgpack parse), then splitmix64's finaliser."""
    n = len(buf)
    m2 = np.uint64(0xBF58476D1CE4E5B9)
    m3 = np.uint64(0x94D049BB133111EB)
    b = 0
    while b < max_blocks:
        acc = np.uint64(0)
        prev = np.uint64(0)
        for k in range(block_size):
            if pos >= n:
                return b, pos
            c = buf[pos]
            if c == 0xCD:
                if pos + 2 >= n:
                    return -1, pos
                v = (np.uint64(buf[pos + 1]) << np.uint64(8)) | np.uint64(buf[pos + 2])
                pos += 3
            elif c == 0xCE:
                if pos + 4 >= n:
                    return -1, pos
                v = (
                    (np.uint64(buf[pos + 1]) << np.uint64(24))
                    | (np.uint64(buf[pos + 2]) << np.uint64(16))
                    | (np.uint64(buf[pos + 3]) << np.uint64(8))
                    | np.uint64(buf[pos + 4])
                )
                pos += 5
            elif c < 0x80:
                v = np.uint64(c)
                pos += 1
            elif c == 0xCC:
                if pos + 1 >= n:
                    return -1, pos
                v = np.uint64(buf[pos + 1])
                pos += 2
            else:
                return -1, pos
            if k & 1:
                acc += (prev + _K[k - 1]) * (v + _K[k])
            else:
                prev = v
        if block_size & 1:
            acc += (prev + _K[block_size - 1]) * _K[block_size]
        h = acc ^ np.uint64(block_size)
        h = (h ^ (h >> np.uint64(30))) * m2
        h = (h ^ (h >> np.uint64(27))) * m3
        out[b] = h ^ (h >> np.uint64(31))
        b += 1
    return b, pos


@njit(cache=True, nogil=True)
def _chain(content: Any, prev: Any, out: Any) -> None:
    p = np.uint64(0x9E3779B97F4A7C15)
    c = prev
    for i in range(len(content)):
        c = c * p + content[i]
        out[i] = c


@njit(cache=True, nogil=True)
def _parse_chain(
    buf: Any, pos: int, block_size: int, max_blocks: int, prev: Any, out: Any
) -> tuple[int, int]:
    """``_parse_blocks`` then ``_chain`` in place, in one call (the lookup's hot path)."""
    got, end = _parse_blocks(buf, pos, block_size, max_blocks, out)
    if got > 0:
        _chain(out[:got], prev, out[:got])
    return got, end


def array_header(raw: bytes | memoryview) -> tuple[int, int]:
    """(element count, header length) of a msgpack array."""
    if not raw:
        raise TokenEncodingError("empty")
    b = raw[0]
    if 0x90 <= b <= 0x9F:
        return b & 0x0F, 1
    if b == 0xDC and len(raw) >= 3:
        return int.from_bytes(raw[1:3], "big"), 3
    if b == 0xDD and len(raw) >= 5:
        return int.from_bytes(raw[1:5], "big"), 5
    raise TokenEncodingError(f"not a msgpack array (0x{b:02x})")


def content_hashes_raw(raw: bytes | memoryview, block_size: int) -> tuple[I64Array, int]:
    """Content hashes of every full block of a msgpack-encoded token array, and its token count.

    Raises ``TokenEncodingError`` unless the array holds only uints and nothing follows it."""
    if not 0 < block_size <= MAX_BLOCK_SIZE:
        raise TokenEncodingError(f"block size {block_size} outside 1..{MAX_BLOCK_SIZE}")
    count, hdr = array_header(raw)
    nblocks = count // block_size
    buf = np.frombuffer(raw, dtype=np.uint8)
    out = np.empty(nblocks, dtype=np.uint64)
    got, end = _parse_blocks(buf, hdr, block_size, nblocks, out)
    if got != nblocks:
        raise TokenEncodingError("token ids must be msgpack uints")
    if count % block_size == 0 and end != len(buf):
        raise TokenEncodingError("trailing bytes after token ids")
    return out.view(np.int64), count


@njit(inline="always")
def block_nh(tokens: Any, base: int, block_size: int) -> Any:
    """``_parse_blocks``'s hash of the block ``tokens[base : base + block_size]`` (checked uint32 values),
    as a uint64: inlined into the kernels that hash as they go."""
    acc = np.uint64(0)
    for k in range(1, block_size, 2):
        acc += (np.uint64(tokens[base + k - 1]) + _K[k - 1]) * (np.uint64(tokens[base + k]) + _K[k])
    if block_size & 1:
        acc += (np.uint64(tokens[base + block_size - 1]) + _K[block_size - 1]) * _K[block_size]
    h = acc ^ np.uint64(block_size)
    h = (h ^ (h >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    h = (h ^ (h >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return h ^ (h >> np.uint64(31))


@njit(cache=True, nogil=True, boundscheck=False)
def _array_blocks(tokens: Any, block_size: int, n_blocks: int, out: Any) -> None:
    """``_parse_blocks``'s block hash over an integer array (values already checked to be uint32)."""
    for b in range(n_blocks):
        out[b] = block_nh(tokens, b * block_size, block_size)


TokenIds = Sequence[int] | npt.NDArray[np.integer[Any]]
"""Token ids as Python ints or as an integer array (uint32 from the tokenizer cache: hashed in place)."""


def id_list(tokens: TokenIds) -> list[int]:
    """The ids as a new list of Python ints (``tolist`` for an array: ~4x faster than ``list``)."""
    return tokens.tolist() if isinstance(tokens, np.ndarray) else list(tokens)


def content_hashes(
    tokens: TokenIds,
    block_size: int,
    start_block: int = 0,
    n_blocks: int = -1,
) -> I64Array:
    """``H_k`` for full blocks ``start_block .. start_block + n_blocks`` (all remaining full blocks if -1).

    ``tokens``: a sequence of ints, or an integer numpy array (hashed in place, no conversion)."""
    full = len(tokens) // block_size - start_block
    n = full if n_blocks < 0 else min(n_blocks, full)
    if n <= 0:
        return _EMPTY_I64
    lo = start_block * block_size
    seg = tokens[lo : lo + n * block_size] if lo or n != full else tokens
    if isinstance(seg, np.ndarray):
        return _content_hashes_array(seg, block_size, n)
    try:
        raw = _ENCODE(seg)
    except TypeError:
        try:
            raw = _ENCODE([int(t) for t in seg])  # numpy arrays and other sequences of ints
        except (TypeError, ValueError, OverflowError) as e:
            raise TokenEncodingError(str(e)) from None
    except OverflowError as e:
        raise TokenEncodingError(str(e)) from None
    out = np.empty(n, dtype=np.uint64)
    got, _ = _parse_blocks(np.frombuffer(raw, dtype=np.uint8), _header_len(raw[0]), block_size, n, out)
    if got != n:
        raise TokenEncodingError("token ids must be ints in 0 .. 2**32-1")
    return out.view(np.int64)


def checked_tokens(seg: npt.NDArray[np.integer[Any]], block_size: int) -> npt.NDArray[np.integer[Any]]:
    """The ids as a contiguous integer array the compiled kernels read (uint32 passes as is).  Raises
    ``TokenEncodingError`` for a bad block size or ids outside 0 .. 2**32-1."""
    if not 0 < block_size <= MAX_BLOCK_SIZE:
        raise TokenEncodingError(f"block size {block_size} outside 1..{MAX_BLOCK_SIZE}")
    if seg.dtype == np.uint32:  # the tokenizer cache's arrays: nothing to check
        return seg if seg.flags.c_contiguous else np.ascontiguousarray(seg)
    if seg.dtype.kind not in "iu":
        raise TokenEncodingError(f"token ids must be integers, not {seg.dtype}")
    if len(seg) and (int(seg.min()) < 0 or int(seg.max()) > 0xFFFFFFFF):
        raise TokenEncodingError("token ids must be ints in 0 .. 2**32-1")
    return np.ascontiguousarray(seg)


def _content_hashes_array(seg: npt.NDArray[np.integer[Any]], block_size: int, n: int) -> I64Array:
    out = np.empty(n, dtype=np.uint64)
    _array_blocks(checked_tokens(seg, block_size), block_size, n, out)
    return out.view(np.int64)


@njit(cache=True, nogil=True)
def _array_chain(tokens: Any, block_size: int, n_blocks: int, prev: Any, out: Any) -> None:
    """``_array_blocks`` then ``_chain`` in place, in one call (the gateway's lookup from an array)."""
    _array_blocks(tokens, block_size, n_blocks, out)
    _chain(out, prev, out)


def _header_len(b: int) -> int:
    return 1 if b < 0xDC else (3 if b == 0xDC else 5)


def chained_hashes(tokens: TokenIds, block_size: int, start_block: int, n_blocks: int, prev: int) -> I64Array:
    """Chain hashes of full blocks ``start_block .. start_block + n_blocks`` of ``tokens`` after a block
    chained ``prev``: ``chain(content_hashes(...), prev)`` in one compiled pass."""
    full = len(tokens) // block_size - start_block
    n = min(n_blocks, full)
    if n <= 0:
        return _EMPTY_I64
    lo = start_block * block_size
    if isinstance(tokens, np.ndarray):  # hashed in place, in one compiled pass
        out = np.empty(n, dtype=np.uint64)
        seg = checked_tokens(tokens[lo : lo + n * block_size], block_size)
        _array_chain(seg, block_size, n, np.uint64(prev & _MASK), out)
        return out.view(np.int64)
    try:
        raw = _ENCODE(tokens[lo : lo + n * block_size])
    except (TypeError, OverflowError):
        return chain(content_hashes(tokens, block_size, start_block, n), prev)
    out = np.empty(n, dtype=np.uint64)
    got, _ = _parse_chain(
        np.frombuffer(raw, dtype=np.uint8), _header_len(raw[0]), block_size, n, np.uint64(prev & _MASK), out
    )
    if got != n:
        raise TokenEncodingError("token ids must be ints in 0 .. 2**32-1")
    return out.view(np.int64)


def chain(content: I64Array, prev: int) -> I64Array:
    """Chain values of the blocks whose content hashes are ``content``, after a block chained ``prev``.

    For the first block of a sequence pass ``prev = base`` (the namespace's base hash)."""
    out = np.empty(len(content), dtype=np.uint64)
    if len(content):
        _chain(content.view(np.uint64), np.uint64(prev & _MASK), out)
    return out.view(np.int64)


def warmup() -> None:
    """Compile (or load from numba's cache) the hashing kernels now rather than on the first event."""
    request_chains(list(range(32)), 16)
    chained_hashes(list(range(32)), 16, 0, 2, 0)
    chained_hashes(np.arange(32, dtype=np.uint32), 16, 0, 2, 0)


def chain_one(content: int, prev: int) -> ChainHash:
    return ChainHash(to_i64(_P * (prev & _MASK) + (content & _MASK)))


def request_chains(
    tokens: TokenIds, block_size: int, *, lora_name: str | None = None, cache_salt: str | None = None
) -> I64Array:
    """Our chain hashes of every full block of a request's prompt, in its (LoRA, salt) namespace: the one
    function a request's hashes come from (the gateway, the cache-hit API, benchmarks, tests)."""
    return chain(content_hashes(tokens, block_size), base_hash(lora_name, cache_salt))
