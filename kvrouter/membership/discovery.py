"""Kubernetes discovery: the instances behind a vLLM Service, from its EndpointSlices, kept current with
the API server's list-and-watch protocol.

::

          ┌──────────────── 410 Gone (HTTP status or ERROR event), or continue token expired ─┐
          ▼                                                                                  │
    LIST (pages) ──RV──▶ WATCH from RV ──events──▶ SliceCache ──instances changed──▶ on_instances
                          ▲   │  BOOKMARK: RV only
                          │   ▼
                          └── server ended it (timeoutSeconds), connection lost, API error (backoff)
                              resume from the last RV seen: no relist, no event lost

Invariants: the instance set changes only from data the API server sent, never from an error (an outage
of the API server keeps the last known fleet); ``on_instances`` is called after the first LIST and then
only when the set differs from the last one given; a relist replaces the cache whole, so what was deleted
while we were away is gone from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections import Counter
from collections.abc import Callable

import aiohttp
import msgspec

from indexer.config import InstanceConfig

from .config import DiscoveryConfig, KubeConnection
from .endpointslices import EndpointSlice, EndpointSliceList, SliceCache, Status, WatchEvent
from .errors import ApiStatusError, BadWatchData, DiscoveryError, ResourceExpired
from .kube import KubeClient

log = logging.getLogger("kvrouter.membership.discovery")

_list_decoder = msgspec.json.Decoder(EndpointSliceList)
_event_decoder = msgspec.json.Decoder(WatchEvent)
_slice_decoder = msgspec.json.Decoder(EndpointSlice)
_status_decoder = msgspec.json.Decoder(Status)


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


class EndpointSliceDiscovery:
    """``start()`` / ``stop()``; ``on_instances(list)`` receives each new instance set."""

    def __init__(
        self,
        cfg: DiscoveryConfig,
        conn: KubeConnection,
        session: aiohttp.ClientSession,
        on_instances: Callable[[list[InstanceConfig]], None],
        *,
        rng: random.Random | None = None,
    ) -> None:
        self.cfg = cfg
        self.client = KubeClient(conn, session)
        self.on_instances = on_instances
        self.path = f"/apis/discovery.k8s.io/v1/namespaces/{conn.namespace}/endpointslices"
        self.selector = f"kubernetes.io/service-name={cfg.service}"
        self.cache = SliceCache()
        self.instances: list[InstanceConfig] | None = None
        """The last set given to ``on_instances`` (None before the first LIST)."""
        self.skipped: Counter[str] = Counter()
        """Endpoints left out of the last set, by reason (a gauge, recomputed with it)."""
        self.counters: Counter[str] = Counter()
        """lists, relists, watches, events_<TYPE>, gone, errors_<reason>, updates."""
        self.synced = asyncio.Event()
        """Set once the first LIST has been applied."""
        self._backoff = Backoff(cfg.backoff_min_s, cfg.backoff_max_s, rng or random.Random())
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name=f"discovery-{self.cfg.service}")

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
                loop = asyncio.get_running_loop()
                t0 = loop.time()
                got = await self._watch()
                if got or loop.time() - t0 >= 1.0:
                    self._backoff.reset()
                    continue
                await asyncio.sleep(self._backoff.next())  # ended at once with nothing: do not spin
            except ResourceExpired:
                self.counters["gone"] += 1
                log.info("resourceVersion expired; relisting", extra={"rv": self.cache.resource_version})
                need_list = True
            except (DiscoveryError, aiohttp.ClientError, TimeoutError) as e:
                reason = e.reason if isinstance(e, DiscoveryError) else type(e).__name__
                self.counters[f"errors_{reason}"] += 1
                delay = self._backoff.next()
                log.warning(
                    "kubernetes API error; keeping the last known fleet",
                    extra={"reason": reason, "error": str(e), "retry_in_s": round(delay, 3)},
                )
                await asyncio.sleep(delay)

    # ------------------------------------------------------------------ list and watch
    async def _list(self) -> None:
        items: list[EndpointSlice] = []
        cont: str | None = None
        rv = ""
        while True:
            params = {"labelSelector": self.selector, "limit": str(self.cfg.page_size)}
            if cont:
                params["continue"] = cont
            body = await self.client.get(self.path, params)
            try:
                page = _list_decoder.decode(body)
            except msgspec.DecodeError as e:
                raise BadWatchData(f"list: {e}") from None
            items.extend(page.items or [])
            rv = rv or page.metadata.resource_version  # every page is of the first page's snapshot
            cont = page.metadata.continue_
            if not cont:
                break
        self.counters["relists" if self.synced.is_set() else "lists"] += 1
        self.cache.replace(items, rv)
        self._emit()
        self.synced.set()
        self._backoff.reset()

    async def _watch(self) -> int:
        """Watch from the cache's version until the server ends the stream; returns the lines received."""
        params = {
            "labelSelector": self.selector,
            "watch": "1",
            "resourceVersion": self.cache.resource_version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(self.cfg.watch_timeout_s),
        }
        self.counters["watches"] += 1
        n = 0
        # aclosing: a line that ends the watch (410, bad data) closes the response now, not at GC.
        async with contextlib.aclosing(
            self.client.watch(self.path, params, self.cfg.watch_timeout_s + 30.0)
        ) as lines:
            async for line in lines:
                n += 1
                self._on_line(line)
        return n

    def _on_line(self, line: bytes) -> None:
        try:
            ev = _event_decoder.decode(line)
            if ev.type == "ERROR":
                st = _status_decoder.decode(ev.object)
                self.counters["events_ERROR"] += 1
                if st.code == 410:
                    raise ResourceExpired(st.message or "watch: resourceVersion expired")
                raise ApiStatusError(st.code, f"watch ERROR event {st.reason}: {st.message}")
            obj = _slice_decoder.decode(ev.object)
        except msgspec.DecodeError as e:
            raise BadWatchData(f"watch: {e}") from None
        self.counters[f"events_{ev.type}"] += 1
        if ev.type not in ("ADDED", "MODIFIED", "DELETED", "BOOKMARK"):
            raise BadWatchData(f"watch: unknown event type {ev.type!r}")
        if self.cache.apply(ev.type, obj):
            self._emit()

    def _emit(self) -> None:
        insts, self.skipped = self.cache.instances(self.cfg)
        if insts == self.instances:
            return
        self.instances = insts
        self.counters["updates"] += 1
        self.on_instances(list(insts))
