"""One worker's side of the host's ``/metrics`` (``kvrouter serve --workers N``).

::

    scraped worker k:  own snapshot ─▶ board row k;  generation g = board.ask()
                       one byte down every other worker's wake pipe ─▶ wait (≤ timeout) until each
                       live worker answered g ─▶ read every row ─▶ metric_merge.merge ─▶ the exposition
    worker j (woken):  its snapshot ─▶ board row j, answered g          (on its own event loop)

Nothing here runs per request: each worker's metrics stay plain in-process counters; a scrape costs one
snapshot per worker.  The wake pipes are made by the supervisor before the fork (every worker inherits
every pipe; a replacement inherits its predecessor's).  A worker that does not answer in time (dead,
or stuck) is shown as of its last snapshot, which only lags.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Iterable

import msgspec
from prometheus_client.core import Metric

from . import MetricsBoard, SnapshotTooLarge
from .metric_merge import Snapshot, decode, encode, merge, plus_base, snapshot

log = logging.getLogger("kvrouter.host")

WakePipes = list[tuple[int, int]]
"""(read end, write end) per worker, non-blocking."""


def wake_pipes(n: int) -> WakePipes:
    out = []
    for _ in range(n):
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        out.append((r, w))
    return out


class HostScrape:
    def __init__(
        self,
        board: MetricsBoard,
        pipes: WakePipes,
        collect: Callable[[], Iterable[Metric]],
        *,
        refresh: Callable[[], None] = lambda: None,
        timeout_s: float = 1.0,
    ) -> None:
        self.board = board
        self.me = board.me
        self.pipes = pipes
        self.collect = collect
        """This worker's own families (its registry's ``collect``)."""
        self.refresh = refresh
        """Brings the worker's scrape-time gauges up to date (called before every snapshot)."""
        self.timeout_s = timeout_s
        self.base: Snapshot | None = None
        self.late = 0
        """Scrapes in which some worker did not answer in time (shown as of its last snapshot)."""
        self.too_large = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Answer wake-ups on this loop; a replacement takes its predecessor's last counts as its base."""
        prev = self.board.read(self.me)
        if prev is not None:
            try:
                self.base = decode(prev)
            except msgspec.DecodeError:
                self.base = None
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.pipes[self.me][0], self._woken)
        self.board.set_live(True)

    def stop(self) -> None:
        self.board.set_live(False)
        if self._loop is not None:
            self._loop.remove_reader(self.pipes[self.me][0])
            self._loop = None

    # ------------------------------------------------------------------ answering
    def own(self) -> Snapshot:
        self.refresh()
        return plus_base(snapshot(self.me, self.collect()), self.base)

    def _publish(self, snap: Snapshot, generation: int | None) -> None:
        try:
            self.board.publish(encode(snap), generation)
        except SnapshotTooLarge as e:
            self.too_large += 1
            if self.too_large == 1:
                log.warning("metrics snapshot too large for the host's board", extra={"error": str(e)})

    def _woken(self) -> None:
        try:
            while os.read(self.pipes[self.me][0], 4096):
                pass
        except BlockingIOError:
            pass
        g = self.board.generation()  # read first: the snapshot is taken after the scrape asked
        self._publish(self.own(), g)

    # ------------------------------------------------------------------ scraping
    async def families(self) -> list[Metric]:
        """Every worker's families, merged: what this host's ``/metrics`` shows."""
        own = self.own()
        self._publish(own, None)  # kept: what the host showed of this worker, should it crash
        g = self.board.ask()
        for k, (_, w) in enumerate(self.pipes):
            if k != self.me:
                try:
                    os.write(w, b"s")
                except (BlockingIOError, BrokenPipeError):
                    pass  # a full pipe already holds a wake-up
        deadline = time.monotonic() + self.timeout_s
        while self.board.pending(g):
            if time.monotonic() >= deadline:
                self.late += 1
                break
            await asyncio.sleep(0.001)
        snaps = [own]
        for k in range(len(self.pipes)):
            if k == self.me:
                continue
            raw = self.board.read(k)
            if raw is None:
                continue
            try:
                snaps.append(decode(raw))
            except msgspec.DecodeError:
                continue
        return merge(snaps, self.me)
