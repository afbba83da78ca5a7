"""Warm restarts: the index snapshots itself to a file or Redis, and a restarted router starts from it.

::

    start:   store.load() ──Indexer.restore──▶ index + positions ──▶ subscriber.start()
                                                                     └─ on connect: replay from ``last``
    running: every interval_s  Indexer.snapshot() (in the loop, synchronous) ──▶ store.save (off-loop)
    stop:    one last snapshot

A snapshot that does not fit (another hash version or block size, corrupt, missing) is counted and the
router starts cold, as it would have without one.  A restored source counts as disconnected from the
moment of the restore (``mark_restored``), so one that never reconnects has its restored blocks dropped
by the subscriber's existing ``stale_after_s`` rule instead of being trusted forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Protocol

import redis
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter, Gauge

from indexer import Indexer, SourceKey
from indexer.errors import ConfigError
from indexer.snapshot import SnapshotError
from indexer.subscriber import EventSubscriber

from .config import SnapshotConfig

log = logging.getLogger("kvrouter.replicas.warm")


class SnapshotStore(Protocol):
    async def save(self, data: bytes) -> None: ...

    async def load(self) -> bytes | None:
        """The latest snapshot, or None if there is none."""
        ...

    async def close(self) -> None:
        """Release what the store opened itself (``WarmRestart.stop`` calls it)."""
        ...


class FileSnapshotStore:
    """A file, replaced atomically (write a sibling, fsync, rename): a crash mid-save keeps the old one."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def _save(self, data: bytes) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=self.path.name + ".", suffix=".tmp", dir=self.path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def _load(self) -> bytes | None:
        try:
            return self.path.read_bytes()
        except FileNotFoundError:
            return None

    async def save(self, data: bytes) -> None:
        await asyncio.to_thread(self._save, data)

    async def load(self) -> bytes | None:
        return await asyncio.to_thread(self._load)

    async def close(self) -> None:
        pass


class RedisSnapshotStore:
    """One Redis key (``SET`` replaces it atomically), optionally expiring."""

    def __init__(
        self,
        client: aioredis.Redis,
        key: str = "{kvrouter}:snapshot",
        ttl_s: float | None = None,
        *,
        owns_client: bool = False,
    ) -> None:
        self.client = client
        self.key = key
        self.ttl_ms = None if ttl_s is None else int(ttl_s * 1000)
        self.owns_client = owns_client

    async def save(self, data: bytes) -> None:
        await self.client.set(self.key, data, px=self.ttl_ms)

    async def load(self) -> bytes | None:
        raw = await self.client.get(self.key)
        return raw.encode() if isinstance(raw, str) else raw

    async def close(self) -> None:
        if self.owns_client:
            await self.client.aclose()


def store_for(cfg: SnapshotConfig, redis_url: str | None) -> SnapshotStore | None:
    """The store the config names (None: warm restart off)."""
    if cfg.path is not None:
        return FileSnapshotStore(cfg.path)
    if cfg.redis_key is not None:
        if redis_url is None:
            raise ConfigError("snapshot.redis_key needs replicas.redis_url")
        client = aioredis.Redis.from_url(redis_url, decode_responses=False)
        return RedisSnapshotStore(client, cfg.redis_key, cfg.ttl_s, owns_client=True)
    return None


def mark_restored(subscriber: EventSubscriber, sources: Collection[SourceKey], now: float) -> None:
    """Restored sources count as disconnected since ``now`` until they connect (call after
    ``subscriber.start()``): one that never returns is dropped after ``stale_after_s``."""
    for src in sources:
        status = subscriber.status.get(src)
        if status is not None and not status.connected:
            status.disconnected_at = now


class WarmRestart:
    """Periodic snapshots of one indexer, and its restore at start."""

    def __init__(
        self,
        indexer: Indexer,
        store: SnapshotStore,
        *,
        interval_s: float = 60.0,
        registry: CollectorRegistry | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self.indexer = indexer
        self.store = store
        self.interval_s = interval_s
        self.wall_clock = wall_clock
        r = registry or CollectorRegistry(auto_describe=False)
        self.snapshots = Counter(
            "kvrouter_index_snapshots",
            "Index snapshots saved or restored, by result",
            ["op", "result"],
            registry=r,
        )
        self.snapshot_bytes = Gauge(
            "kvrouter_index_snapshot_bytes", "Size of the last snapshot saved", registry=r
        )
        self._task: asyncio.Task[None] | None = None

    async def restore(self, *, only: Collection[SourceKey] | None = None) -> list[SourceKey]:
        """Load the latest snapshot into the (empty) indexer; [] when there is none or it does not fit."""
        try:
            data = await self.store.load()
        except (redis.RedisError, OSError) as e:
            self.snapshots.labels("restore", "unreachable").inc()
            log.warning("snapshot store unreachable; starting cold", extra={"error": repr(e)})
            return []
        if data is None:
            self.snapshots.labels("restore", "none").inc()
            return []
        try:
            restored = self.indexer.restore(data, only=only)
        except SnapshotError as e:
            self.snapshots.labels("restore", e.reason).inc()
            log.warning("snapshot not restored; starting cold", extra={"reason": e.reason, "error": str(e)})
            return []
        self.snapshots.labels("restore", "ok").inc()
        log.info("index restored from snapshot", extra={"sources": len(restored), "bytes": len(data)})
        return restored

    async def save_once(self) -> bool:
        data = self.indexer.snapshot(created_at=self.wall_clock())  # synchronous: one consistent instant
        try:
            await self.store.save(data)
        except (redis.RedisError, OSError) as e:
            self.snapshots.labels("save", "error").inc()
            log.warning("snapshot not saved", extra={"error": repr(e)})
            return False
        self.snapshots.labels("save", "ok").inc()
        self.snapshot_bytes.set(len(data))
        return True

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="kvrouter-snapshots")

    async def stop(self, *, final: bool = True) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if final:
            await self.save_once()
        await self.store.close()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.save_once()
