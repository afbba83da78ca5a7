"""Sequence tracking under the faults the reliability suite found: a replay from ``last`` that comes back
empty (the engine restarted and has not reached our sequence: without this rule its stale blocks stayed
trusted), and the idle probe that fetches a lost last batch."""

from __future__ import annotations

from indexer import Indexer, SourceKey, Trust
from indexer.encode import PayloadEncoder
from indexer.sources import Apply, Phase, Replay, Reset, SourceSync

BS = 4


def live_at(last: int, ts: float = 10.0) -> SourceSync:
    s = SourceSync(has_replay=True)
    s.phase, s.trust, s.last, s.last_ts = Phase.LIVE, Trust.EXACT, last, ts
    return s


def test_an_empty_replay_from_last_is_a_restarted_engine() -> None:
    s = live_at(30)
    assert s.on_connect() == [Replay(30)]
    assert s.on_replay_end() == [Reset(), Replay(0)]
    assert s.trust is Trust.COLD and s.last is None and s.restarts == 1
    assert s.on_replay(0, b"p0", 20.0) == [Apply(0, b"p0")]
    assert s.on_replay_end() == []
    assert s.trust is Trust.EXACT and s.last == 0 and s.phase is Phase.LIVE


def test_a_timed_out_replay_is_no_evidence_of_a_restart() -> None:
    s = live_at(30)
    s.on_connect()
    assert s.on_replay_end(complete=False) == []
    assert s.trust is Trust.EXACT and s.last == 30 and s.restarts == 0


def test_the_same_engine_answers_with_last_itself() -> None:
    s = live_at(30, ts=10.0)
    assert s.on_idle() == [Replay(30)]
    assert s.on_replay(30, b"", 10.0) == []  # already applied
    assert s.on_replay(31, b"p31", 11.0) == [Apply(31, b"p31")]  # the lost tail
    assert s.on_replay_end() == []
    assert s.trust is Trust.EXACT and s.last == 31 and s.restarts == 0


def test_idle_probe_only_when_live_with_history() -> None:
    assert SourceSync(has_replay=True).on_idle() == []
    s = live_at(3)
    s.on_idle()
    assert s.on_idle() == []  # already syncing


def test_a_restored_index_forgets_an_engine_that_restarted_below_its_position() -> None:
    """Snapshot at seq 30; the engine restarted meanwhile and published 2 batches: its old blocks go."""
    enc = PayloadEncoder()
    ix = Indexer(BS)
    src = SourceKey("v", 0)
    ix.register(src, has_replay=True)
    old = enc.batch([enc.stored([1], None, [1, 2, 3, 4], BS)], ts=10.0)
    sync = ix.sync(src)
    ix.apply_payload("v", old, _source=src)
    sync.phase, sync.trust, sync.last, sync.last_ts = Phase.LIVE, Trust.EXACT, 30, 10.0
    assert ix.on_connect(src) == [30]
    assert ix.on_replay_end(src) == [0]  # nothing at or after 30: a new process
    assert ix.lookup([1, 2, 3, 4]).best() is None or ix.lookup([1, 2, 3, 4]).best().matched_blocks == 0  # type: ignore[union-attr]
    new = enc.batch([enc.stored([9], None, [5, 6, 7, 8], BS)], ts=20.0)
    ix.on_replay(src, 0, new)
    ix.on_replay_end(src)
    assert ix.trust(src) is Trust.EXACT
    assert max(m.matched_blocks for m in ix.lookup([5, 6, 7, 8]).instances) == 1


def test_a_live_batch_a_replay_already_applied_is_skipped_not_a_restart() -> None:
    """Under a flood the replay runs ahead of the SUB socket's queue; the queued batches are old, not a
    restarted engine (before this rule every one of them wiped the source)."""
    s = live_at(10, ts=10.0)
    assert s.on_live(20, b"p20", 20.0) == [Replay(11)]  # a gap
    for q in range(11, 51):
        s.on_replay(q, b"", float(q))
    s.on_replay_end()
    assert s.last == 50 and s.trust is Trust.EXACT
    assert s.on_live(21, b"", 21.0) == []  # still queued in the socket, already applied
    assert s.restarts == 0 and s.stale_live == 1 and s.trust is Trust.EXACT
    out = s.on_live(0, b"n0", 99.0)  # a new process: back to 0, stamped later
    assert out[0] == Reset() and s.restarts == 1
