"""Index snapshots for warm restarts: blocks plus every source's sequence position and trust.

::

    Indexer ──snapshot()──▶ msgpack: header (format, HASH_VERSION, block_size) + sources + blocks
       ▲                                              │ a shell stores it (file, Redis) and reloads it
       └──restore()──── checks header ◀───────────────┘ at start, before the subscriber connects

A restored source is LIVE at its last applied sequence, with its trust and last timestamp.  When the
subscriber connects, ``SourceSync.on_connect`` asks for a replay from that ``last``: the engine's buffer
fills only what happened while we were down; a newer timestamp at ``last`` says the engine restarted
meanwhile (its blocks are reset and the new process is replayed from 0); a buffer that no longer reaches
``last`` leaves the source ``degraded``.  Without a replay endpoint the first live batch decides the same
way (in order: apply; a gap: degraded; an older sequence: restart).

Invariant: blocks and positions are taken in one synchronous call, so they describe the same instant.
Speculative entries are left out: they live seconds, on the process's own clock.  Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

import msgspec

from .errors import IndexerError
from .hashing import HASH_VERSION
from .index import SourceBlocks
from .sources import Phase
from .types import SourceKey, Trust

if TYPE_CHECKING:
    from .indexer import Indexer

SNAPSHOT_FORMAT = 1
"""Bumped whenever the snapshot layout changes; older snapshots are refused, never misread."""


class SnapshotError(IndexerError):
    """A snapshot that cannot be restored here."""

    reason = "snapshot"


class SnapshotCorrupt(SnapshotError):
    reason = "snapshot_corrupt"


class SnapshotMismatch(SnapshotError):
    """Another snapshot format, hash version or block size: its chain hashes would not match ours."""

    reason = "snapshot_mismatch"


class SourceState(msgspec.Struct, array_like=True, gc=False):
    """One publisher's sequence position and trust at snapshot time."""

    source: SourceKey
    has_replay: bool
    trust: str
    last: int | None
    last_ts: float | None
    last_event_ts: float | None
    block_size_mismatch: int | None


class _Header(msgspec.Struct):
    format: int
    hash_version: int
    block_size: int


class Snapshot(msgspec.Struct):
    format: int
    hash_version: int
    block_size: int
    created_at: float
    """The caller's wall clock when taken (informative: how old a restored state is)."""
    sources: list[SourceState]
    blocks: list[SourceBlocks]


_ENCODER = msgspec.msgpack.Encoder()
_HEADER = msgspec.msgpack.Decoder(_Header)
_SNAPSHOT = msgspec.msgpack.Decoder(Snapshot)


def take(ix: Indexer, *, created_at: float = 0.0) -> bytes:
    """Encode the indexer's state."""
    states = []
    for src in ix.sources():
        sync = ix.sync(src)
        states.append(
            SourceState(
                src,
                sync.has_replay,
                sync.trust.value,
                sync.last,
                sync.last_ts,
                ix.last_event_ts.get(src),
                ix.block_size_mismatch.get(src),
            )
        )
    # Shared stores' blocks are left out: what a store without removals holds is an estimate kept by its
    # age book, which a snapshot does not carry; the attached instances' writes rebuild it.
    blocks = [b for b in ix.index.export_sources() if b.source[1] >= 0]
    snap = Snapshot(SNAPSHOT_FORMAT, HASH_VERSION, ix.block_size, created_at, states, blocks)
    return _ENCODER.encode(snap)


def decode(data: bytes, *, block_size: int) -> Snapshot:
    """Check the header, then decode.  Raises ``SnapshotMismatch`` or ``SnapshotCorrupt``."""
    try:
        head = _HEADER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise SnapshotCorrupt(f"not a snapshot: {e}") from None
    want = (SNAPSHOT_FORMAT, HASH_VERSION, block_size)
    got = (head.format, head.hash_version, head.block_size)
    if got != want:
        raise SnapshotMismatch(f"(format, hash version, block size) is {got}, expected {want}")
    try:
        return _SNAPSHOT.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise SnapshotCorrupt(str(e)) from None


def restore(ix: Indexer, data: bytes, *, only: Collection[SourceKey] | None = None) -> list[SourceKey]:
    """Load a snapshot into an indexer that holds no blocks yet; returns the sources restored.

    ``only`` keeps just those sources (e.g. the fleet file's, so instances that left are not revived).
    A source already registered keeps its ``has_replay`` (the fleet file is newer than the snapshot)."""
    snap = decode(data, block_size=ix.block_size)
    if ix.index.total_entries():
        raise SnapshotError("restore into an index that already holds blocks")
    keep = None if only is None else set(only)
    restored: list[SourceKey] = []
    for st in snap.sources:
        src = SourceKey(*st.source)
        if keep is not None and src not in keep:
            continue
        known = src in ix.sources()
        sync = ix.register(src, has_replay=ix.sync(src).has_replay if known else st.has_replay)
        # Mid-replay at snapshot time or not, the restored source is LIVE at its last applied batch (the
        # on-connect replay refills the rest); with nothing applied in sequence it starts over as COLD,
        # keeping the trust direct library use gave it.
        sync.last, sync.last_ts = st.last, st.last_ts
        sync.phase, sync.trust = (Phase.COLD if st.last is None else Phase.LIVE), Trust(st.trust)
        if st.last_event_ts is not None:
            ix.last_event_ts[src] = st.last_event_ts
        if st.block_size_mismatch is not None:
            ix.block_size_mismatch[src] = st.block_size_mismatch
        restored.append(src)
    ix.index.import_sources([b for b in snap.blocks if keep is None or SourceKey(*b.source) in keep])
    return restored
