"""The per-publisher sequence state machine: gaps, replays, late joins, restarts, trust."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.sources import Apply, Replay, Reset, SourceSync
from indexer.types import Trust


def applied(actions: list[object]) -> list[int]:
    return [a.seq for a in actions if isinstance(a, Apply)]


def test_in_order_from_zero_is_exact() -> None:
    s = SourceSync(has_replay=True)
    assert applied(s.on_live(0, b"a")) == [0]
    assert applied(s.on_live(1, b"b")) == [1]
    assert s.trust is Trust.EXACT and s.last == 1


def test_gap_requests_replay_buffers_live_and_drains_in_order() -> None:
    s = SourceSync(has_replay=True)
    s.on_live(0, b"")
    assert s.on_live(3, b"3") == [Replay(1)]
    assert s.on_live(4, b"4") == []  # buffered while syncing
    out = s.on_replay(1, b"1") + s.on_replay(2, b"2") + s.on_replay(3, b"3") + s.on_replay_end()
    assert applied(out) == [1, 2, 3, 4]
    assert s.trust is Trust.EXACT and s.gaps == 1 and s.unfilled == 0


def test_gap_older_than_the_replay_buffer_degrades() -> None:
    s = SourceSync(has_replay=True)
    s.on_live(0, b"")
    assert s.on_live(50, b"") == [Replay(1)]
    out = [a for q in range(40, 51) for a in s.on_replay(q, b"")] + s.on_replay_end()
    assert applied(out) == list(range(40, 51))
    assert s.trust is Trust.DEGRADED and s.unfilled == 1
    s.on_cleared()
    assert s.trust is Trust.EXACT


def test_gap_without_replay_degrades_at_once() -> None:
    s = SourceSync(has_replay=False)
    s.on_live(0, b"")
    assert applied(s.on_live(5, b"")) == [5]
    assert s.trust is Trust.DEGRADED


def test_late_join_replays_from_zero() -> None:
    s = SourceSync(has_replay=True)
    assert s.on_live(7, b"7") == [Replay(0)]
    out = [a for q in range(8) for a in s.on_replay(q, b"")] + s.on_replay_end()
    assert applied(out) == list(range(8))
    assert s.trust is Trust.EXACT


def test_late_join_beyond_the_buffer_is_partial_not_degraded() -> None:
    s = SourceSync(has_replay=True)
    s.on_live(20_000, b"")
    out = s.on_replay(10_001, b"") + s.on_replay(20_000, b"") + s.on_replay_end()
    assert applied(out) == [10_001, 20_000]
    assert s.trust is Trust.PARTIAL
    s.mark_degraded()  # unknown parents are expected for a partial source
    assert s.trust is Trust.PARTIAL


def test_late_join_without_replay_is_partial() -> None:
    s = SourceSync(has_replay=False)
    assert applied(s.on_live(9, b"")) == [9]
    assert s.trust is Trust.PARTIAL


def test_sequence_going_backwards_is_a_restart() -> None:
    s = SourceSync(has_replay=True)
    for q in range(5):
        s.on_live(q, b"")
    out = s.on_live(0, b"new")
    assert isinstance(out[0], Reset) and applied(out) == [0]
    assert s.trust is Trust.EXACT and s.restarts == 1


def test_connect_asks_for_replay_and_empty_replay_means_exact() -> None:
    s = SourceSync(has_replay=True)
    assert s.on_connect() == [Replay(0)]
    assert s.on_connect() == []  # already syncing
    assert s.on_replay_end() == []
    assert s.trust is Trust.EXACT
    assert applied(s.on_live(0, b"")) == [0]


def test_batch_zero_lost_after_an_empty_replay_is_replayed() -> None:
    s = SourceSync(has_replay=True)
    s.on_connect()
    s.on_replay_end()  # the engine had published nothing yet
    assert s.on_live(1, b"x", 1.0) == [Replay(0)]  # seq 0 was lost on the way: fetch it


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 60),
    drops=st.sets(st.integers(0, 59)),
    buffer=st.integers(0, 60),
)
def test_replay_recovers_every_drop_within_the_buffer(n: int, drops: set[int], buffer: int) -> None:
    """Whatever batches are dropped live, the applied sequence is 0..n-1 in order exactly when the replay
    buffer reaches back far enough; otherwise trust says so."""
    s = SourceSync(has_replay=True)
    out: list[int] = []
    for q in range(n):
        if q in drops:
            continue
        for a in s.on_live(q, b""):
            if isinstance(a, Apply):
                out.append(a.seq)
            elif isinstance(a, Replay):
                oldest = max(0, q - buffer)  # the engine keeps its last `buffer` batches (up to q)
                for r in range(max(a.start, oldest), q + 1):
                    out += applied(s.on_replay(r, b""))
                out += applied(s.on_replay_end())
    assert out == sorted(set(out)), "applied in order, never twice"
    live = [q for q in range(n) if q not in drops]
    if not live:  # nothing ever arrived: nothing applied, nothing known
        assert out == [] and s.trust is Trust.COLD
        return
    # Everything up to the last batch that arrived was applied, exactly when trust says exact.
    complete = out == list(range(live[-1] + 1))
    assert complete == (s.trust is Trust.EXACT), (out, s.trust)
    if buffer >= n:  # the engine's buffer holds everything: nothing can be lost
        assert complete
    else:
        assert s.trust in (Trust.EXACT, Trust.DEGRADED, Trust.PARTIAL)
