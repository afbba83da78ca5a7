"""Writing vLLM KV-event payloads exactly as a given vLLM release does.

Built from the facts of vLLM's schema (fields are only ever appended; <= 0.23 positional, >= 0.24 maps with
fields defaulting to None left out; 0.9 batches carry no rank).  The simulated fleet publishes with this,
and the tests use it to produce each release's shape.  The 0.33 output is byte-identical to vLLM's golden
payloads (see tests/indexer/test_wire.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

RELEASES = (
    "0.9.0", "0.10.0", "0.10.2", "0.11.0", "0.13.0", "0.16.0", "0.20.0", "0.23.0",
    "0.24.0", "0.25.0", "0.26.0", "0.28.0", "0.30.0", "0.32.0", "0.33.0",
)  # fmt: skip
LATEST = RELEASES[-1]

# (field, release that added it, has a default).  Fields without a default are always written.
_STORED_FIELDS: tuple[tuple[str, str, bool], ...] = (
    ("block_hashes", "0.9.0", False),
    ("parent_block_hash", "0.9.0", False),
    ("token_ids", "0.9.0", False),
    ("block_size", "0.9.0", False),
    ("lora_id", "0.9.0", False),
    ("medium", "0.10.2", False),
    ("lora_name", "0.16.0", False),
    ("extra_keys", "0.20.0", True),
    ("group_idx", "0.20.0", True),
    ("kv_cache_spec_kind", "0.23.0", True),
    ("kv_cache_spec_sliding_window", "0.23.0", True),
    ("locality", "0.26.0", True),
    ("ownership", "0.30.0", True),
    ("session_id", "0.30.0", True),
    ("lookahead_token_ids", "0.33.0", True),
)
_REMOVED_FIELDS: tuple[tuple[str, str, bool], ...] = (
    ("block_hashes", "0.9.0", False),
    ("medium", "0.10.2", False),
    ("group_idx", "0.20.0", True),
    ("locality", "0.26.0", True),
    ("ownership", "0.30.0", True),
)


def version_tuple(release: str) -> tuple[int, ...]:
    return tuple(int(p) for p in release.split("."))


def _fields_at(spec: tuple[tuple[str, str, bool], ...], release: str) -> list[tuple[str, bool]]:
    v = version_tuple(release)
    return [(name, dflt) for name, since, dflt in spec if version_tuple(since) <= v]


def _make_struct(name: str, fields: list[tuple[str, bool]], positional: bool) -> type[msgspec.Struct]:
    spec: list[Any] = [(f, Any, None) if dflt else (f, Any) for f, dflt in fields]
    return msgspec.defstruct(
        name, spec, tag=name, array_like=positional, omit_defaults=not positional, gc=False
    )


class PayloadEncoder:
    """Encodes batches in one release's exact shape.  ``uses_map`` and ``has_rank`` tell which shape."""

    def __init__(self, release: str = LATEST) -> None:
        if release not in RELEASES:
            raise ValueError(f"unknown vLLM release {release!r}; known: {', '.join(RELEASES)}")
        self.release = release
        v = version_tuple(release)
        self.uses_map = v >= (0, 24, 0)
        self.has_rank = v >= (0, 10, 0)
        positional = not self.uses_map
        self._stored_fields = _fields_at(_STORED_FIELDS, release)
        self._removed_fields = _fields_at(_REMOVED_FIELDS, release)
        self._stored = _make_struct("BlockStored", self._stored_fields, positional)
        self._removed = _make_struct("BlockRemoved", self._removed_fields, positional)
        self._removed_has_medium = len(self._removed_fields) > 1
        self._removed_tpl: dict[tuple[str | None, int | None], tuple[bytes, bytes]] = {}
        self._cleared = _make_struct("AllBlocksCleared", [], positional)
        self._enc = msgspec.msgpack.Encoder()

    def stored(
        self,
        block_hashes: Sequence[int | bytes],
        parent_block_hash: int | bytes | None,
        token_ids: Sequence[int],
        block_size: int,
        *,
        medium: str | None = "GPU",
        lora_id: int | None = None,
        lora_name: str | None = None,
        extra_keys: list[Any] | None = None,
        group_idx: int | None = 0,
        **more: Any,
    ) -> msgspec.Struct:
        values = (
            list(block_hashes),
            parent_block_hash,
            list(token_ids),
            block_size,
            lora_id,
            medium,
            lora_name,
            extra_keys,
            group_idx,
        )
        args = [*values, *(more.get(f) for f, _ in self._stored_fields[9:])]
        return self._stored(*args[: len(self._stored_fields)])

    def removed(
        self,
        block_hashes: Sequence[int | bytes],
        *,
        medium: str | None = "GPU",
        group_idx: int | None = None,
        locality: str | None = None,
        ownership: str | None = None,
    ) -> msgspec.Struct:
        if (group_idx is None and locality is None and ownership is None) or len(self._removed_fields) < 3:
            # later fields default to None: the same bytes as passing them (the hot path: one per eviction)
            return (
                self._removed(list(block_hashes), medium)
                if self._removed_has_medium
                else self._removed(list(block_hashes))
            )
        args = (list(block_hashes), medium, group_idx, locality, ownership)
        return self._removed(*args[: len(self._removed_fields)])

    def removed_raw(
        self, block_hash: int, medium: str | None = "GPU", group_idx: int | None = None
    ) -> msgspec.Raw:
        """``removed([block_hash], medium=medium, group_idx=group_idx)`` already encoded: the same bytes,
        built from a per-(medium, group) template.  One BlockRemoved is sent per evicted block, so this is
        the encoder's hot path."""
        tpl = self._removed_tpl.get((medium, group_idx))
        if tpl is None:
            sentinel = 0xFEDCBA9876543210
            full = self._enc.encode(self.removed([sentinel], medium=medium, group_idx=group_idx))
            mark = self._enc.encode(sentinel)
            pre, _, post = full.partition(mark)
            tpl = self._removed_tpl[(medium, group_idx)] = (pre, post)
        return msgspec.Raw(tpl[0] + self._enc.encode(block_hash) + tpl[1])

    def removed_run(
        self, block_hashes: Sequence[int], medium: str | None = "GPU", group_idx: int | None = None
    ) -> bytes:
        """``len(block_hashes)`` one-hash BlockRemoved events, encoded back to back (no array header): what
        vLLM sends when a step evicts that many blocks.  Vectorised when every hash needs the 9-byte uint64
        form (the usual case for 64-bit hashes); byte-identical to encoding each ``removed([h])``."""
        if not block_hashes:
            return b""
        arr = np.asarray(block_hashes, dtype=np.uint64) if min(block_hashes) >= 0 else None
        if arr is None or int(arr.min()) < 1 << 32 or max(block_hashes) >= 1 << 64:
            return b"".join(bytes(self.removed_raw(h, medium, group_idx)) for h in block_hashes)
        self.removed_raw(int(arr[0]), medium, group_idx)  # make sure the template exists
        pre, post = self._removed_tpl[(medium, group_idx)]
        n, lp, lq = len(arr), len(pre), len(post)
        rows = np.empty((n, lp + 9 + lq), dtype=np.uint8)
        rows[:, :lp] = np.frombuffer(pre, dtype=np.uint8)
        rows[:, lp] = 0xCF
        rows[:, lp + 1 : lp + 9] = arr.astype(">u8").view(np.uint8).reshape(n, 8)
        rows[:, lp + 9 :] = np.frombuffer(post, dtype=np.uint8)
        return rows.tobytes()

    def batch_of_encoded(self, parts: Sequence[bytes], count: int, *, ts: float, dp_rank: int = 0) -> bytes:
        """A payload whose events are already encoded (``parts`` concatenate to ``count`` events)."""
        if count < 16:
            header = bytes([0x90 | count])
        elif count < 1 << 16:
            header = b"\xdc" + count.to_bytes(2, "big")
        else:
            header = b"\xdd" + count.to_bytes(4, "big")
        events = msgspec.Raw(header + b"".join(parts))
        body: list[Any] = [ts, events]
        if self.has_rank:
            body.append(dp_rank)
        return self._enc.encode(body)

    def cleared(self) -> msgspec.Struct:
        return self._cleared()

    def batch(self, events: Sequence[msgspec.Struct | msgspec.Raw], *, ts: float, dp_rank: int = 0) -> bytes:
        """One payload: ``[ts, events]`` (0.9) or ``[ts, events, data_parallel_rank]``."""
        body: list[Any] = [ts, list(events)]
        if self.has_rank:
            body.append(dp_rank)
        return self._enc.encode(body)
