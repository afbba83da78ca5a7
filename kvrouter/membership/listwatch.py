"""One selection of one collection kept current with the API server's list-and-watch protocol.

::

          ┌──────────────── 410 Gone (HTTP status or ERROR event), or continue token expired ─┐
          ▼                                                                                  │
    LIST (pages) ──RV──▶ WATCH from RV ──events──▶ ObjectCache ──changed──▶ on_change()
                          ▲   │  BOOKMARK: RV only          (the client re-watches from the last RV
                          │   ▼                               each time the server ends a watch)
                          └── connection lost, API error (backoff), nothing heard for idle_s:
                              watch again from the last RV seen: no relist, no event lost

Invariants: the cache changes only from data the API server sent, never from an error (an outage of the
API server keeps the last known state); ``on_change`` runs after the first LIST and after every event that
changed the cache; a relist replaces the cache whole, so what was deleted while we were away is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Generic

from .errors import BadWatchData, DiscoveryError, ResourceExpired
from .kube import KubeApi, R
from .kubetypes import ObjectCache

log = logging.getLogger("kvrouter.membership.discovery")

_EVENTS = ("ADDED", "MODIFIED", "DELETED", "BOOKMARK")


class Backoff:
    """Exponential backoff with full jitter; the rng is passed in (tests seed it)."""

    def __init__(self, lo: float, hi: float, rng: random.Random) -> None:
        self.lo, self.hi, self.rng = lo, hi, rng
        self._n = 0

    def reset(self) -> None:
        self._n = 0

    def next(self) -> float:
        d = min(self.hi, self.lo * 2**self._n)
        self._n = min(self._n + 1, 32)
        return self.lo + self.rng.random() * (d - self.lo)


class ListWatch(Generic[R]):
    """``start()`` / ``stop()``; the cache is ``self.cache``, ``synced`` is set after the first LIST."""

    def __init__(
        self,
        api: KubeApi,
        res: type[R],
        on_change: Callable[[], None],
        *,
        labels: Mapping[str, str] | None = None,
        fields: Mapping[str, str] | None = None,
        page_size: int = 500,
        watch_timeout_s: int = 300,
        backoff: Backoff,
        name: str,
        cache: ObjectCache[R] | None = None,
    ) -> None:
        self.api = api
        self.res: type[R] = res
        self.on_change = on_change
        self.labels = dict(labels or {})
        self.fields = dict(fields or {})
        self.page_size, self.watch_timeout_s = page_size, watch_timeout_s
        self.idle_s = watch_timeout_s + 30.0
        """A watch silent this long (no event, no bookmark, across the client's re-watches) is dropped and
        opened again from the last version: a connection that died without a word is not waited on."""
        self.name = name
        self.cache: ObjectCache[R] = ObjectCache() if cache is None else cache
        self.counters: Counter[str] = Counter()
        """lists, relists, watches, events_<TYPE>, gone, idle, errors_<reason>."""
        self.synced = asyncio.Event()
        self._backoff = backoff
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name=f"listwatch-{self.name}")

    def cancel(self) -> None:
        """Stop without waiting (from a callback, which cannot await)."""
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def run(self) -> None:
        need_list = True
        while True:
            try:
                if need_list:
                    await self._list()
                    need_list = False
                await self._watch()
            except ResourceExpired as e:
                self.counters["gone"] += 1
                if e.event:
                    self.counters["events_ERROR"] += 1
                log.info("resourceVersion expired; relisting", extra={"watch": self.name})
                need_list = True
            except DiscoveryError as e:
                if e.event:
                    self.counters["events_ERROR"] += 1
                self.counters[f"errors_{e.reason}"] += 1
                delay = self._backoff.next()
                log.warning(
                    "kubernetes API error; keeping the last known state",
                    extra={
                        "watch": self.name,
                        "reason": e.reason,
                        "error": str(e),
                        "retry_in_s": round(delay, 3),
                    },
                )
                await asyncio.sleep(delay)

    async def _list(self) -> None:
        items, rv = await self.api.list(
            self.res, labels=self.labels, fields=self.fields, page_size=self.page_size
        )
        self.counters["relists" if self.synced.is_set() else "lists"] += 1
        self.cache.replace(items, rv)
        self.synced.set()  # before on_change: it may read whether this selection has been listed
        self._backoff.reset()
        self.on_change()

    async def _watch(self) -> None:
        """Watch from the cache's version until nothing is heard for ``idle_s`` (then return: the caller
        watches again) or an error is raised."""
        self.counters["watches"] += 1
        loop = asyncio.get_running_loop()
        events = self.api.watch(
            self.res,
            resource_version=self.cache.resource_version,
            labels=self.labels,
            fields=self.fields,
            timeout_s=self.watch_timeout_s,
        )
        idle = asyncio.timeout(self.idle_s)
        try:
            async with contextlib.aclosing(events), idle:
                async for kind, obj in events:
                    idle.reschedule(loop.time() + self.idle_s)
                    self._backoff.reset()
                    self._on_event(kind, obj)
        except TimeoutError:
            if not idle.expired():
                raise
            self.counters["idle"] += 1

    def _on_event(self, kind: str, obj: R) -> None:
        self.counters[f"events_{kind}"] += 1
        if kind not in _EVENTS:
            raise BadWatchData(f"watch: unknown event type {kind!r}")
        if self.cache.apply(kind, obj):
            self.on_change()
