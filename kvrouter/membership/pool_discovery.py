"""Kubernetes discovery through an ``InferencePool``: the pool names the pods (its selector) and their
ports (its target ports); both are followed while the router runs.

A ListWatch of the one pool (by name) gives its ``PoolTarget``; a changed selector starts a new pod
ListWatch (``labelSelector``) in place of the old one, changed ports re-read the same pods, a deleted
pool gives no instances.  The pods go through ``pool_instances`` and, when the set changed, to
``on_instances``.  As the reference Endpoint Picker, except that the API server filters the pods by
selector instead of a cache of the whole namespace.

Invariants: while a new pod watch has not listed, the old selector's pods stay the fleet (a selector
change never empties it on its way); ``on_instances`` is called once both the pool and (if it exists and
is valid) its pods have been listed, then whenever the instance set differs from the last one given;
``synced`` is set then.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter
from collections.abc import Callable
from typing import Any

from indexer.config import InstanceConfig

from .config import DiscoveryConfig
from .inferencepool import InferencePool, PoolRefused, PoolTarget, pool_target
from .kube import InferencePoolResource, KubeApi, PodResource
from .listwatch import Backoff, ListWatch
from .pods import pool_instances

log = logging.getLogger("kvrouter.membership.discovery")


class InferencePoolDiscovery:
    """``start()`` / ``stop()``; ``on_instances(list)`` receives each new instance set."""

    def __init__(
        self,
        cfg: DiscoveryConfig,
        api: KubeApi,
        on_instances: Callable[[list[InstanceConfig]], None],
        *,
        rng: random.Random | None = None,
    ) -> None:
        assert cfg.pool, "InferencePoolDiscovery watches an InferencePool"
        self.cfg = cfg
        self.api = api
        self.on_instances = on_instances
        self._rng = rng or random.Random()
        self.pool: InferencePool | None = None
        """The pool as last read (None before, or once deleted)."""
        self.target: PoolTarget | None = None
        """What the pods are read for (None: no pool, or a refused one)."""
        self.refused: str | None = None
        """Why the pool selects nothing, if it is refused."""
        self.instances: list[InstanceConfig] | None = None
        self.skipped: Counter[str] = Counter()
        self.updates = 0
        self.pools = ListWatch(
            api,
            InferencePoolResource,
            self._pool_changed,
            fields={"metadata.name": cfg.pool},
            page_size=cfg.page_size,
            watch_timeout_s=cfg.watch_timeout_s,
            backoff=self._backoff(),
            name=cfg.source,
        )
        self.pods: ListWatch[PodResource] | None = None
        """The pods of ``pods_target``'s selector (replaced when the selector changes)."""
        self.pods_target: PoolTarget | None = None
        self.retired: Counter[str] = Counter()
        """Counters of pod watches replaced by a new selector's."""
        self._started = False
        self.synced = asyncio.Event()
        """Set with the first instance set (the pool listed and, if it selects pods, its pods listed)."""

    def _backoff(self) -> Backoff:
        return Backoff(self.cfg.backoff_min_s, self.cfg.backoff_max_s, self._rng)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._started = True
        self.pools.start()

    async def stop(self) -> None:
        self._started = False
        await self.pools.stop()
        if self.pods is not None:
            await self.pods.stop()

    @property
    def counters(self) -> Counter[str]:
        """The pool watch's and the pod watches' (every selector's) summed, with ``updates``,
        ``selector_changes`` and ``refused_<reason>``."""
        out = self.pools.counters + self.retired
        if self.pods is not None:
            out += self.pods.counters
        out["updates"] = self.updates
        return out

    def state(self) -> dict[str, Any]:
        t = self.target
        ref = self.pool.spec.endpoint_picker_ref if self.pool is not None else None
        return {
            "source": self.cfg.source,
            "synced": self.synced.is_set(),
            "pool": None if self.pool is None else self.pool.metadata.name,
            "selector": None if t is None else t.label_selector(),
            "target_ports": None if t is None else t.ports,
            "endpoint_picker": None if ref is None else ref.name,
            "refused": self.refused,
            "resource_version": self.pools.cache.resource_version,
            "counters": dict(self.counters),
            "skipped": dict(self.skipped),
        }

    # ------------------------------------------------------------------ the pool
    def _pool_changed(self) -> None:
        pool = next(iter(self.pools.cache.objects.values()), None)
        self.pool = pool
        target: PoolTarget | None = None
        self.refused = None
        if pool is None:
            log.warning("inference pool not found; no instances", extra={"pool": self.cfg.pool})
        else:
            try:
                target = pool_target(pool)
            except PoolRefused as e:
                self.refused = e.reason
                self.retired[f"refused_{e.reason}"] += 1
                log.warning(
                    "inference pool refused; no instances", extra={"pool": self.cfg.pool, "error": str(e)}
                )
        self.target = target
        if target is None:
            self._retire_pods()
            self._emit([], Counter())
            return
        if self.pods_target is None or self.pods_target.selector != target.selector:
            if self.pods_target is not None:
                self.retired["selector_changes"] += 1
                log.info(
                    "inference pool selector changed; reading its pods again",
                    extra={"pool": self.cfg.pool, "selector": target.label_selector()},
                )
            self._watch_pods(target)
        else:
            self.pods_target = target  # the ports (or nothing of ours) changed: the same pods, read again
            self._pods_changed()

    def _watch_pods(self, target: PoolTarget) -> None:
        old = self.pods
        self.pods_target = target
        self.pods = ListWatch(
            self.api,
            PodResource,
            self._pods_changed,
            labels=target.selector,
            page_size=self.cfg.page_size,
            watch_timeout_s=self.cfg.watch_timeout_s,
            backoff=self._backoff(),
            name=f"{self.cfg.source}/pods",
        )
        self._stop_later(old)
        if self._started:
            self.pods.start()

    def _retire_pods(self) -> None:
        self._stop_later(self.pods)
        self.pods = None
        self.pods_target = None

    def _stop_later(self, lw: ListWatch[PodResource] | None) -> None:
        """Stop a replaced pod watch (from a callback: its task is not ours to await here)."""
        if lw is None:
            return
        self.retired += lw.counters
        lw.cancel()

    # ------------------------------------------------------------------ the pods
    def _pods_changed(self) -> None:
        pods, target = self.pods, self.pods_target
        if pods is None or target is None or not pods.synced.is_set():
            return  # a new selector's pods not listed yet: the last instance set stands
        insts, skipped = pool_instances(pods.cache.objects.values(), target, self.cfg)
        self._emit(insts, skipped)

    def _emit(self, insts: list[InstanceConfig], skipped: Counter[str]) -> None:
        self.skipped = skipped
        self.synced.set()
        if insts == self.instances:
            return
        self.instances = insts
        self.updates += 1
        self.on_instances(list(insts))
