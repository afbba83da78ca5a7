"""Per-block extra keys: what vLLM puts beside a block's tokens in its cache key, on both sides of the index.

vLLM keys a block by ``(parent, tokens, extra_keys)``.  Its events (0.20 and later) send one entry per block,
None or ``[lora_name?, [identifier, offset]..., cache_salt?, embeds_digest?]`` (docs/multimodal.md, section
5).  The index keeps LoRA and salt in the chain's base (``hashing.base_hash``); what is left of a block's
keys is mixed into its content hash here, the same way from an event and from a request::

    event entry ──decode_block_keys──▶ BlockKeys(mm=((id, off), ...), other=(...))  ─┐
                                                                                     ├─ mix ─▶ content'
    request items (id, offset, length) ──block_mm_keys──▶ ((id, off), ...) per block ┘

A block's multimodal keys are one ``(identifier, offset - block start)`` pair per item whose placeholder
range ``[offset, offset + length)`` overlaps the block, in prompt order, as vLLM's
``_gen_mm_extra_hash_keys`` computes them (the offset is negative for an item begun in an earlier block).
Keys the router never computes for a request (prompt-embeds digests, shapes of later releases) still change
the block's hash, so such a block never matches a request's.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import msgspec

from .hashing import I64Array, TokenIds, base_hash, chain, chain_one, content_hashes, stable_key_hash

__all__ = [
    "BlockKeys",
    "MMItem",
    "block_mm_keys",
    "decode_block_keys",
    "event_content",
    "mix_blocks",
    "mixed_request_content",
    "mm_request_chains",
]

MMPair = tuple[str, int]
"""``(identifier, offset within the block)``: one multimodal item's key in one block."""

_OTHER_TAG = "kvrouter:other"


ItemKey = tuple[str, int, int]
"""``(identifier, offset, length)`` of one item: an ``MMItem`` or any tuple of that shape."""


class MMItem(NamedTuple):
    """One multimodal item of a prompt: vLLM's identifier and its placeholder range in the prompt's ids."""

    identifier: str
    offset: int
    length: int


class BlockKeys(msgspec.Struct, frozen=True, gc=False):
    """One block's event keys, sorted out (LoRA name and salt stay with the chain's base)."""

    salt: str | None = None
    mm: tuple[MMPair, ...] = ()
    other: tuple[Any, ...] = ()
    """Keys that are neither (prompt-embeds digests, anything unknown): they make the block unmatchable."""


def decode_block_keys(entry: Any, lora_name: str | None, *, first: bool) -> BlockKeys:
    """Sort one event entry (``extra_keys[i]``) into its parts.

    ``first``: the block starts a sequence (its parent is None), where vLLM puts the ``cache_salt``: a
    bare string there (after the LoRA name, which comes first when ``lora_name`` is set)."""
    if not entry:
        return BlockKeys()
    items = list(entry) if isinstance(entry, list | tuple) else [entry]
    if lora_name is not None and items and items[0] == lora_name:
        items = items[1:]
    salt: str | None = None
    mm: list[MMPair] = []
    other: list[Any] = []
    for k in items:
        if (
            isinstance(k, list | tuple)
            and len(k) == 2
            and isinstance(k[0], str)
            and isinstance(k[1], int)
            and not isinstance(k[1], bool)
        ):
            mm.append((k[0], k[1]))
        elif first and salt is None and not other and isinstance(k, str):
            salt = k
        else:
            other.append(k)
    return BlockKeys(salt, tuple(mm), tuple(other))


def block_mm_keys(items: Sequence[ItemKey], num_blocks: int, block_size: int) -> list[tuple[MMPair, ...]]:
    """Each full block's multimodal keys for a prompt with these items (sorted by offset, as vLLM sorts
    them), as vLLM's ``_gen_mm_extra_hash_keys`` walks them block by block."""
    out: list[tuple[MMPair, ...]] = []
    idx = 0
    for b in range(num_blocks):
        start, end = b * block_size, (b + 1) * block_size
        keys: list[MMPair] = []
        i = idx
        while i < len(items):
            ident, offset, length = items[i]
            if end <= offset:
                break  # the block has not reached this item
            if start >= offset + length:
                i += 1  # the block is past this item
                continue
            keys.append((ident, offset - start))
            if end >= offset + length:
                i += 1  # this block holds the item's end: the next item may begin in it too
            else:
                break
        idx = i
        out.append(tuple(keys))
    return out


def _key_hash(mm: Sequence[MMPair], other: Sequence[Any] = ()) -> int:
    value: list[Any] = [[i, o] for i, o in mm]
    if other:
        value.append([_OTHER_TAG, list(other)])
    return stable_key_hash(value)


def mix_blocks(
    content: I64Array, mm: Sequence[Sequence[MMPair]], other: Sequence[Sequence[Any]] | None = None
) -> I64Array:
    """Content hashes with each block's remaining keys mixed in (blocks without keys are unchanged).

    ``mm[i]`` / ``other[i]``: block i's keys; shorter lists leave the later blocks unchanged."""
    out: I64Array | None = None
    for i in range(min(len(content), len(mm))):
        extra = other[i] if other is not None and i < len(other) else ()
        if not mm[i] and not extra:
            continue
        if out is None:
            out = content.copy()
        out[i] = chain_one(int(out[i]), _key_hash(mm[i], extra))
    return content if out is None else out


def mixed_request_content(content: I64Array, items: Sequence[ItemKey], block_size: int) -> I64Array:
    """A request's content hashes with its items' keys mixed in, as an event's would be."""
    if not items:
        return content
    return mix_blocks(content, block_mm_keys(items, len(content), block_size))


def event_content(
    content: I64Array, entries: Sequence[Any], lora_name: str | None, *, first: bool
) -> I64Array:
    """An event's content hashes with each block's decoded keys mixed in (``first``: the event's first
    block starts a sequence, so its salt is the base's, not mixed)."""
    mm: list[tuple[MMPair, ...]] = []
    other: list[tuple[Any, ...]] = []
    for i, entry in enumerate(entries[: len(content)]):
        k = decode_block_keys(entry, lora_name, first=first and i == 0)
        mm.append(k.mm)
        other.append(k.other)
    return mix_blocks(content, mm, other)


def mm_request_chains(
    tokens: TokenIds,
    block_size: int,
    items: Sequence[ItemKey],
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> I64Array:
    """``hashing.request_chains`` for a prompt with multimodal items: each block's items mixed into its
    content hash before chaining, as the index does with an event's keys."""
    content = content_hashes(tokens, block_size)
    return chain(mixed_request_content(content, items, block_size), base_hash(lora_name, cache_salt))
