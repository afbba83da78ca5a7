"""The engine's own block hash: what a simulated vLLM puts in ``block_hashes``.

vLLM hashes ``(parent_hash or NONE_HASH, tuple(block_token_ids), extra_keys)`` with sha256 and reports the
digest's last 8 bytes as an int.  That costs about a microsecond a block in Python, too slow for the
evaluator (~9M blocks per run), so the model keeps the *structure* and changes the function::

    h_0 = mix(NONE_HASH, T_0, E_0)          NONE_HASH = mix of the engine's ``hash_seed``
    h_k = mix(h_{k-1}, T_k, E_k)            T_k = a 64-bit hash of block k's token ids (one compiled pass:
                                                  ``indexer.hashing.content_hashes``, reused for speed)
                                            E_k = digest of block k's extra keys, 0 when it has none

so a hash still depends on every token before it, on the LoRA name (every block) and on ``cache_salt``
(block 0 only), exactly the inputs vLLM uses.  The values differ from kvrouter's ``ChainHash`` (another
mixing function and seed), as vLLM's do: the indexer must treat them as opaque ids.  Collisions have
probability ~n²/2**65, as for vLLM's truncated digests.
"""

from __future__ import annotations

import hashlib
from typing import Any, cast

import msgspec
import numpy as np
from numba import njit

from indexer.hashing import I64Array, TokenIds, content_hashes
from kvrouter.lab.sim.engine.events import ExtraKeys
from kvrouter.lab.sim.engine.types import BlockHash

_MASK = (1 << 64) - 1


def _splitmix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def none_hash(seed: int) -> BlockHash:
    """The parent of every block 0 (vLLM's NONE_HASH: fixed per seed, shared by a fleet as on vLLM 0.30+)."""
    return BlockHash(_splitmix(_splitmix(seed & _MASK) ^ 0x6E6F6E655F686173))


def extra_digest(keys: ExtraKeys) -> int:
    """A stable 64-bit digest of one block's extra keys; 0 for none."""
    if not keys:
        return 0
    d = hashlib.blake2b(msgspec.msgpack.encode(list(keys)), digest_size=8).digest()
    return int.from_bytes(d, "little") | 1


@njit(cache=True, nogil=True)
def _chain(content: Any, parent: Any, extra_first: Any, extra_rest: Any, out: Any) -> None:
    m1 = np.uint64(0xBF58476D1CE4E5B9)
    m2 = np.uint64(0x94D049BB133111EB)
    g = np.uint64(0x9E3779B97F4A7C15)
    h = parent
    for i in range(len(content)):
        e = extra_first if i == 0 else extra_rest
        x = ((h + g) * m1) ^ content[i]
        x = x ^ (e * m2)
        x = (x ^ (x >> np.uint64(30))) * m1
        x = (x ^ (x >> np.uint64(27))) * m2
        h = x ^ (x >> np.uint64(31))
        out[i] = h


def chain_hashes(
    tokens: TokenIds,
    block_size: int,
    *,
    parent: int,
    first_extra: int,
    rest_extra: int,
    start_block: int = 0,
    n_blocks: int = -1,
) -> list[BlockHash]:
    """Hashes of full blocks ``start_block ..`` of ``tokens``, chained after ``parent``.

    ``first_extra`` is mixed into the first block hashed here (pass block 0's digest when ``start_block`` is
    0, else the same value as ``rest_extra``)."""
    content: I64Array = content_hashes(tokens, block_size, start_block, n_blocks)
    n = len(content)
    if n == 0:
        return []
    out = np.empty(n, dtype=np.uint64)
    _chain(
        content.view(np.uint64),
        np.uint64(parent & _MASK),
        np.uint64(first_extra & _MASK),
        np.uint64(rest_extra & _MASK),
        out,
    )
    return cast(list[BlockHash], out.tolist())


def block_extra_keys(
    lora_name: str | None,
    cache_salt: str | None,
    block_index: int,
    mm: tuple[tuple[str, int], ...] = (),
) -> ExtraKeys:
    """vLLM's ``generate_block_hash_extra_keys`` as its events carry them: the LoRA name, the block's
    multimodal ``(identifier, offset)`` pairs (``indexer.extra_keys.block_mm_keys``), the salt on block 0."""
    keys: list[Any] = []
    if lora_name is not None:
        keys.append(lora_name)
    keys.extend(mm)
    if cache_salt and block_index == 0:
        keys.append(cache_salt)
    return tuple(keys) if keys else None


def chain_hashes_keyed(
    tokens: TokenIds, block_size: int, *, parent: int, extras: list[int], start_block: int = 0
) -> list[BlockHash]:
    """``chain_hashes`` with each block's own extra-key digest (``extras[i]`` for block
    ``start_block + i``): multimodal prompts, whose blocks carry different keys."""
    out: list[BlockHash] = []
    for i, e in enumerate(extras):
        got = chain_hashes(
            tokens,
            block_size,
            parent=parent,
            first_extra=e,
            rest_extra=e,
            start_block=start_block + i,
            n_blocks=1,
        )
        if not got:
            break
        out.extend(got)
        parent = got[0]
    return out


def warmup() -> None:
    """Compile (or load from numba's cache) the kernel now rather than on the first request."""
    chain_hashes(list(range(32)), 16, parent=1, first_extra=0, rest_extra=0)
