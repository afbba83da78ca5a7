"""Sequence tracking for one event publisher (an instance's data-parallel rank), as a pure state machine.

vLLM numbers each publisher's batches from 0, +1 per batch, stamps each with the engine's clock and keeps
the last ``buffer_steps`` for replay.  From (seq, ts) alone::

    seq == last + 1                  in order: apply
    seq >  last + 1                  a gap (HWM drop, slow joiner): replay from last + 1, buffer live batches
    seq <= last, ts newer            a newer engine process: it restarted, drop the source's state
    seq <= last, ts not newer        already applied (replay overlap, or still queued in the socket): skip
    first seq > 0                    we joined late: replay from 0

After a reconnect the replay starts at ``last`` itself: the same timestamp there means the same process,
a later one that it restarted while we were away.  States: COLD -> LIVE on the first batch; LIVE ->
SYNCING on a gap, late join or reconnect; SYNCING -> LIVE at replay end or timeout.  Methods return the
actions the shell must carry out, in order; nothing here does I/O.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import msgspec

from .types import Trust


class Phase(enum.Enum):
    COLD = "cold"
    SYNCING = "syncing"
    LIVE = "live"


class Apply(msgspec.Struct, gc=False):
    seq: int
    payload: bytes


class Reset(msgspec.Struct, gc=False):
    """The engine restarted: drop every block of the source before applying anything further."""


class Replay(msgspec.Struct, gc=False):
    start: int


Action = Apply | Reset | Replay


class SourceSync:
    """Sequence state and trust of one publisher."""

    def __init__(self, *, has_replay: bool, max_pending: int = 10_000) -> None:
        self.has_replay = has_replay
        self.max_pending = max_pending
        self.phase = Phase.COLD
        self._trust = Trust.COLD
        self.on_trust_change: Callable[[], None] | None = None
        """Called after every change of ``trust`` (the owning ``Indexer`` caches lookup answers by trust)."""
        self.last: int | None = None
        self.last_ts: float | None = None
        self.pending: dict[int, tuple[bytes, float | None]] = {}
        self.gaps = 0
        self.unfilled = 0
        self.restarts = 0
        self.replays = 0
        self.dropped_pending = 0
        self.stale_live = 0
        """Live batches already applied by a replay that ran ahead of the socket's queue (skipped)."""
        self._mid_stream = False  # the current sync fills a gap after applied batches (vs. a late join)
        self._from_last = False  # the current replay started at ``last`` itself (reconnect, idle probe)
        self._received = 0  # replayed batches received in the current sync

    @property
    def trust(self) -> Trust:
        return self._trust

    @trust.setter
    def trust(self, value: Trust) -> None:
        if value is not self._trust:
            self._trust = value
            if self.on_trust_change is not None:
                self.on_trust_change()

    def _newer_process(self, seq: int, ts: float | None) -> bool:
        return (
            self.last is not None
            and seq <= self.last
            and ts is not None
            and self.last_ts is not None
            and ts > self.last_ts
        )

    # ------------------------------------------------------------------ live stream
    def on_live(self, seq: int, payload: bytes, ts: float | None = None) -> list[Action]:
        if self.phase is Phase.SYNCING:
            if self._newer_process(seq, ts):
                return self._restart(seq, payload, ts)
            if self.last is None or seq > self.last:
                if len(self.pending) < self.max_pending:
                    self.pending[seq] = (payload, ts)
                else:
                    self.dropped_pending += 1
            return []
        if self.phase is Phase.COLD:
            return self._first(seq, payload, ts)
        last = self.last
        if last is None:
            # Live, but nothing applied yet (an empty replay on connect): the first batch must be seq 0.
            return self._first(seq, payload, ts)
        if seq == last + 1:
            return self._apply(seq, payload, ts)
        if seq <= last:
            if ts is not None and self.last_ts is not None and ts <= self.last_ts:
                # Not newer than what we applied: a batch the replay already brought, still queued in the
                # SUB socket when the replay raced ahead of the live stream.  Skip it; a restart would
                # wipe the source (a new process stamps its batches later than our last one).
                self.stale_live += 1
                return []
            return self._restart(seq, payload, ts)
        self.gaps += 1
        if self.has_replay:
            return self._start_sync(last + 1, seq, payload, ts, mid_stream=True)
        self.unfilled += 1
        self.trust = Trust.DEGRADED
        return self._apply(seq, payload, ts)

    def _restart(self, seq: int, payload: bytes, ts: float | None) -> list[Action]:
        self.restarts += 1
        self.last = self.last_ts = None
        self.trust = Trust.COLD
        self.phase = Phase.COLD
        self.pending = {}
        return [Reset(), *self._first(seq, payload, ts)]

    def _first(self, seq: int, payload: bytes, ts: float | None) -> list[Action]:
        if seq == 0:
            self.phase = Phase.LIVE
            self.trust = Trust.EXACT
            return self._apply(seq, payload, ts)
        if self.has_replay:
            return self._start_sync(0, seq, payload, ts, mid_stream=False)
        self.phase = Phase.LIVE
        self.trust = Trust.PARTIAL
        return self._apply(seq, payload, ts)

    def _start_sync(
        self, start: int, seq: int, payload: bytes, ts: float | None, *, mid_stream: bool
    ) -> list[Action]:
        self.phase = Phase.SYNCING
        self._mid_stream = mid_stream
        self._from_last = False
        self._received = 0
        self.pending = {seq: (payload, ts)}
        self.replays += 1
        return [Replay(start)]

    def _apply(self, seq: int, payload: bytes, ts: float | None) -> list[Action]:
        self.last = seq
        if ts is not None:
            self.last_ts = ts
        return [Apply(seq, payload)]

    # ------------------------------------------------------------------ connection
    def on_connect(self) -> list[Action]:
        """A (re)connection: ask for everything the engine still buffers, so a late start loses nothing.
        After earlier batches, start at ``last`` itself to tell the same engine from a restarted one."""
        if not self.has_replay or self.phase is Phase.SYNCING:
            return []
        self.phase = Phase.SYNCING
        self._mid_stream = self.last is not None
        self._from_last = self.last is not None
        self._received = 0
        self.pending = {}
        self.replays += 1
        return [Replay(0 if self.last is None else self.last)]

    def on_idle(self) -> list[Action]:
        """The source went quiet: ask once for anything after ``last``, as a reconnect does (vLLM sends no
        heartbeat, so a dropped final batch would otherwise be seen only at the engine's next step)."""
        if self.phase is not Phase.LIVE or self.last is None:
            return []
        return self.on_connect()

    # ------------------------------------------------------------------ replay stream
    def on_replay(self, seq: int, payload: bytes, ts: float | None = None) -> list[Action]:
        if self.phase is not Phase.SYNCING:
            return []
        self._received += 1
        if self._newer_process(seq, ts):
            # The engine restarted while we were away: forget it, then replay the new process from 0.
            self.restarts += 1
            self.last = self.last_ts = None
            self.trust = Trust.COLD
            pending = dict(self.pending)
            self.pending = {}
            out: list[Action] = [Reset(), *self._start_sync(0, seq, payload, ts, mid_stream=False)]
            self.pending.update({q: v for q, v in pending.items() if ts is None or (v[1] or 0) >= ts})
            return out
        last = self.last
        if last is None:
            if seq == 0:
                self.trust = Trust.EXACT
            elif self.trust is not Trust.DEGRADED:
                self.trust = Trust.PARTIAL
            return self._apply(seq, payload, ts)
        if seq <= last:
            return []
        if seq > last + 1:
            self._unfilled()
        return self._apply(seq, payload, ts)

    def on_replay_end(self, *, complete: bool = True) -> list[Action]:
        """The replay finished (end marker; ``complete``) or timed out or could not be asked for: apply
        what was buffered meanwhile, in order."""
        if self.phase is not Phase.SYNCING:
            return []
        if complete and self._from_last and not self._received:
            return self._restarted_below_last()
        self.phase = Phase.LIVE
        out: list[Action] = []
        pending, self.pending = self.pending, {}
        for seq in sorted(pending):
            payload, ts = pending[seq]
            if self._newer_process(seq, ts):
                out.extend(self._restart(seq, payload, ts))
                continue
            last = self.last
            if last is None:
                if seq == 0:
                    self.trust = Trust.EXACT if self.trust is not Trust.DEGRADED else self.trust
                elif self.trust is Trust.COLD:
                    self.trust = Trust.PARTIAL
            elif seq <= last:
                continue
            elif seq > last + 1:
                self._unfilled()
            out.extend(self._apply(seq, payload, ts))
        if self.phase is Phase.LIVE and self.last is None and self.trust is Trust.COLD and self.has_replay:
            # An empty replay: the engine has published nothing yet, so nothing was missed.
            self.trust = Trust.EXACT
        return out

    def _restarted_below_last(self) -> list[Action]:
        """A replay from ``last`` came back empty: the engine holds no batch at or after ``last``.  One
        process always keeps its newest batch and a publisher never goes back, so this is a new process
        whose sequence has not reached ours yet (its batches would all look like old ones): forget the
        source and replay the new process from 0, keeping the live batches buffered meanwhile."""
        self.restarts += 1
        self.last = self.last_ts = None
        self.trust = Trust.COLD
        self._mid_stream = self._from_last = False
        self._received = 0
        self.replays += 1
        return [Reset(), Replay(0)]

    def _unfilled(self) -> None:
        self.unfilled += 1
        if self._mid_stream or self.trust is Trust.EXACT:
            self.trust = Trust.DEGRADED
        elif self.trust is Trust.COLD:
            self.trust = Trust.PARTIAL

    @property
    def catching_up(self) -> bool:
        """Replaying the source's past (a late join, a gap, a reconnect): what is applied now happened
        before the live batches buffered meanwhile."""
        return self.phase is Phase.SYNCING

    # ------------------------------------------------------------------ index events
    def on_cleared(self) -> None:
        """AllBlocksCleared: the engine's cache and our view of it are both empty, so exact again."""
        if self.trust in (Trust.DEGRADED, Trust.PARTIAL):
            self.trust = Trust.EXACT

    def mark_degraded(self) -> None:
        """The index met an inconsistency (e.g. an unknown parent) in a stream believed complete.

        A partial source (late join) lacks history by definition: unknown parents there are expected and
        only make it hold too little, which is what ``partial`` already says."""
        if self.trust is Trust.EXACT:
            self.trust = Trust.DEGRADED
