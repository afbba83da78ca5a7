"""Kubernetes discovery: the instances behind a vLLM Service, from its EndpointSlices, kept current with the
API server's list-and-watch protocol (``listwatch``), over the Kubernetes client (``kube``).

::

    ListWatch(EndpointSlices, labelSelector kubernetes.io/service-name=<service>) ──▶ SliceCache
        ──▶ instances_of(slices) ──changed?──▶ on_instances(list)

Invariants: ``on_instances`` is called after the first LIST and then only when the instance set differs
from the last one given; an outage of the API server keeps the last known fleet.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from typing import Any

from indexer.config import InstanceConfig

from .config import DiscoveryConfig
from .endpointslices import instances_of
from .kube import EndpointSliceResource, KubeApi
from .listwatch import Backoff, ListWatch


class EndpointSliceDiscovery:
    """``start()`` / ``stop()``; ``on_instances(list)`` receives each new instance set."""

    def __init__(
        self,
        cfg: DiscoveryConfig,
        api: KubeApi,
        on_instances: Callable[[list[InstanceConfig]], None],
        *,
        rng: random.Random | None = None,
    ) -> None:
        assert cfg.service, "EndpointSliceDiscovery watches a Service"
        self.cfg = cfg
        self.api = api
        self.on_instances = on_instances
        self.instances: list[InstanceConfig] | None = None
        """The last set given to ``on_instances`` (None before the first LIST)."""
        self.skipped: Counter[str] = Counter()
        """Endpoints left out of the last set, by reason (a gauge, recomputed with it)."""
        self.updates = 0
        self.list_watch = ListWatch(
            api,
            EndpointSliceResource,
            self._emit,
            labels={"kubernetes.io/service-name": cfg.service},
            page_size=cfg.page_size,
            watch_timeout_s=cfg.watch_timeout_s,
            backoff=Backoff(cfg.backoff_min_s, cfg.backoff_max_s, rng or random.Random()),
            name=cfg.source,
        )
        self.cache = self.list_watch.cache
        """The watched slices by name, and the version to resume from."""
        self.synced = self.list_watch.synced
        """Set once the first LIST has been applied."""

    @property
    def counters(self) -> Counter[str]:
        """lists, relists, watches, events_<TYPE>, gone, idle, errors_<reason>, updates."""
        return self.list_watch.counters + Counter(updates=self.updates)

    def start(self) -> None:
        self.list_watch.start()

    async def stop(self) -> None:
        await self.list_watch.stop()

    def state(self) -> dict[str, Any]:
        return {
            "source": self.cfg.source,
            "synced": self.synced.is_set(),
            "resource_version": self.cache.resource_version,
            "counters": dict(self.counters),
            "skipped": dict(self.skipped),
        }

    def _emit(self) -> None:
        insts, self.skipped = instances_of(list(self.cache.objects.values()), self.cfg)
        if insts == self.instances:
            return
        self.instances = insts
        self.updates += 1
        self.on_instances(list(insts))
