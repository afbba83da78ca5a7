"""Fleet-file reload: the file is read and hashed every ``interval_s``; a new hash is parsed like at startup
and its ``instances`` become the desired set of the ``fleet`` source.

::

    every interval_s: read ── sha256 same ──▶ nothing
                              sha256 new ──▶ load(path) ── ok ──▶ Reconciler.set_desired("fleet", ..)
                                                │                  other sections changed: restart
                                                └── error ──▶ counted once, old membership kept

Why hash every time and not trust mtime: mtime has coarse granularity on some filesystems (two writes in
one tick look the same), and Kubernetes updates a mounted ConfigMap by swapping a symlink, which the hash
sees like any other change.  A fleet file is a few kilobytes, so reading it every second costs nothing.
The file is read again by ``load``: if it changed in between, the next poll sees a hash
different from the one recorded and parses it again, so the last version always wins.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

from indexer.config import FleetConfig
from indexer.errors import ConfigError

from .errors import FleetReloadError
from .model import sections_changed
from .reconcile import Reconciler

log = logging.getLogger("kvrouter.membership.fleetfile")


C = TypeVar("C", bound=FleetConfig)


class FleetFileWatcher(Generic[C]):
    """``start()`` / ``stop()``, or ``poll()`` by hand.  ``config`` is the last valid file."""

    def __init__(
        self,
        path: str | Path,
        reconciler: Reconciler,
        running: C,
        *,
        load: Callable[[Path], C],
        interval_s: float = 1.0,
        source: str = "fleet",
        on_config: Callable[[C, list[str]], None] | None = None,
    ) -> None:
        """``running`` is the config the process started with; sections other than ``instances`` that
        differ from it are reported in ``pending_restart`` (and passed to ``on_config``, which may apply
        the ones it knows to be safe).  ``load`` parses a file (the gateway's fleet-file loader)."""
        self.path = Path(path)
        self.reconciler = reconciler
        self.running = running
        self.config = running
        self.interval_s = interval_s
        self.source = source
        self.load = load
        self.on_config = on_config
        self.pending_restart: list[str] = []
        self.counters: Counter[str] = Counter()
        """reloads, errors_unreadable, errors_invalid."""
        self.last_error: FleetReloadError | None = None
        self._hash: bytes | None = None  # of the last version parsed, valid or not; None: none yet
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="fleet-file-watch")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        while True:
            self.poll()
            await asyncio.sleep(self.interval_s)

    def poll(self) -> bool:
        """Read the file once; True if a new valid version was applied."""
        try:
            data = self.path.read_bytes()
        except OSError as e:
            self._fail(FleetReloadError("unreadable", str(e)), None)
            return False
        digest = hashlib.sha256(data).digest()
        if digest == self._hash:
            return False
        try:
            new = self.load(self.path)
        except ConfigError as e:
            self._fail(FleetReloadError("invalid", str(e)), digest)
            return False
        self._hash = digest
        self.last_error = None
        self.config = new
        self.counters["reloads"] += 1
        d = self.reconciler.set_desired(self.source, new.instances)
        pending = sections_changed(self.running, new)
        if pending != self.pending_restart:
            self.pending_restart = pending
            if pending:
                log.warning(
                    "fleet file sections changed; they take effect at the next restart",
                    extra={"sections": pending, "path": str(self.path)},
                )
        log.info("fleet file reloaded", extra={"path": str(self.path), **d.summary()})
        if self.on_config:
            self.on_config(new, pending)
        return True

    def _fail(self, err: FleetReloadError, digest: bytes | None) -> None:
        """Counted and logged once per bad version (or once per spell of unreadability)."""
        if self.last_error is not None and self.last_error.reason == err.reason and digest == self._hash:
            return
        self._hash = digest
        self.last_error = err
        self.counters[f"errors_{err.reason}"] += 1
        log.error(
            "fleet file not applied; keeping the current membership",
            extra={"path": str(self.path), "reason": err.reason, "error": str(err)},
        )
