"""Trust for routers that read a shared ``RedisBlockIndex`` and ingest nothing themselves.

::

    kvrouter indexer (ingests) ──every interval_s: publish_trust(ttl_s)──▶ Redis {ns}:trust
    stateless router           ◀─every interval_s: read_trust ──────────── (gone if the writer dies)
                               └─ its Indexer's SourceSync.trust = published value (absent: cold)

The router's ``Indexer`` holds no sequence state of its own in that deployment; mirroring the writer's
trust keeps the routing rule unchanged (only exact and partial sources earn cache credit), and a writer
that stops publishing takes the credit away within ``ttl_s``: its index may go stale unnoticed otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import redis

from indexer import Indexer, Trust
from indexer.redis_index import RedisBlockIndex

log = logging.getLogger("kvrouter.replicas.trust")


class TrustMirror:
    """``writer=True`` on the ingesting indexer, ``writer=False`` on each router reading the index."""

    def __init__(
        self,
        indexer: Indexer,
        index: RedisBlockIndex,
        *,
        writer: bool,
        interval_s: float = 1.0,
        ttl_s: float = 5.0,
    ) -> None:
        if ttl_s < 2 * interval_s:
            raise ValueError("ttl_s must be at least twice interval_s")
        self.indexer = indexer
        self.index = index
        self.writer = writer
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self.errors = 0
        self._task: asyncio.Task[None] | None = None

    def publish_once(self) -> None:
        ix = self.indexer
        self.index.publish_trust({s: ix.trust(s) for s in ix.sources()}, ttl_s=self.ttl_s)

    def apply_once(self) -> None:
        published = self.index.read_trust()
        ix = self.indexer
        for src in set(ix.sources()) | set(published):
            ix.sync(src).trust = published.get(src, Trust.COLD)

    async def once(self) -> bool:
        try:
            if self.writer:
                await asyncio.to_thread(self.publish_once)
            else:
                self.apply_once()  # the read is one small HGETALL; applying must stay on the loop's thread
        except (redis.RedisError, OSError) as e:
            self.errors += 1
            if self.errors == 1 or self.errors % 60 == 0:
                log.warning("trust not mirrored", extra={"writer": self.writer, "error": repr(e)})
            return False
        return True

    async def start(self) -> None:
        await self.once()
        self._task = asyncio.create_task(self._run(), name="kvrouter-trust-mirror")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.once()
