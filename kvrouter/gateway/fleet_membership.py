"""``FleetMembership``: the ``Membership`` seam over the gateway's own objects.

::

    add     EventSubscriber.add_instance ──connect──▶ replay of the engine's buffer (late join)
            UpstreamPool.add ──▶ GET /health ──pass──▶ in rotation
    drain   UpstreamPool.drain ──▶ not a candidate; in_flight from the LoadTracker
    remove  EventSubscriber.remove_instance ──▶ Indexer.remove_instance (its blocks dropped)
            UpstreamPool.remove ──▶ LoadTracker.forget (each rank)

Order on remove: events first, then the pool, so that once the name leaves the pool nothing of it is left
to route by.  The subscriber's ``fleet`` is kept equal to what is applied, because bind mode looks a
publishing instance's replay endpoint up there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec

from indexer import Indexer
from indexer.config import InstanceConfig
from indexer.subscriber import EventSubscriber

from .upstream import UpstreamPool

log = logging.getLogger("kvrouter.membership")


class FleetMembership:
    """Applies membership steps to an ``UpstreamPool``, an ``Indexer`` and (if events are subscribed) its
    ``EventSubscriber``.  ``on_added`` / ``on_removed`` let the gateway keep per-instance metrics in step."""

    def __init__(
        self,
        pool: UpstreamPool,
        indexer: Indexer,
        subscriber: EventSubscriber | None,
        *,
        on_added: Callable[[InstanceConfig], None] | None = None,
        on_removed: Callable[[InstanceConfig], None] | None = None,
    ) -> None:
        self.pool = pool
        self.indexer = indexer
        self.subscriber = subscriber
        self.on_added = on_added
        self.on_removed = on_removed
        initial = subscriber.fleet.instances if subscriber else [u.cfg for u in pool.upstreams.values()]
        self._configs: dict[str, InstanceConfig] = {i.name: i for i in initial}
        """What is applied, by name (the reconciler's ``applied``, seen from here)."""
        self._found: dict[str, InstanceConfig] = {}
        """Instances whose events were found on the instance itself (``/kv_event_sources``), not given."""

    def _with_found(self, inst: InstanceConfig) -> InstanceConfig:
        """``inst`` as given, with the events found on the instance when the given config has none."""
        f = self._found.get(inst.name)
        if f is None or inst.events is not None or inst.url != f.url:
            return inst
        return msgspec.structs.replace(
            inst,
            events=f.events,
            events_mode=f.events_mode,
            replay=f.replay,
            topic=f.topic,
            dp_size=f.dp_size,
        )

    def found(self, name: str) -> InstanceConfig | None:
        """What ``/kv_event_sources`` last gave for ``name`` (as applied), if it was asked."""
        return self._found.get(name)

    def discoverable(self, name: str) -> InstanceConfig | None:
        """The config to ask ``/kv_event_sources`` with, if ``name``'s events are not given (found before,
        or never): None when the fleet gives them, or the instance is unknown."""
        cfg = self._configs.get(name)
        if cfg is None or cfg.url is None:
            return None
        if name in self._found:
            return msgspec.structs.replace(cfg, events=None, replay=None)
        return cfg if cfg.events is None else None

    async def rewire(self, inst: InstanceConfig) -> None:
        """``inst``'s event endpoints were found on the instance: subscribe to them (again, if they moved:
        the old subscription and its blocks go, as after any restart)."""
        if self.pool.upstreams.get(inst.name) is None:
            return  # it left while we asked
        given = self.discoverable(inst.name) or inst  # as the fleet gives it: no events
        self._found[inst.name] = inst
        inst = self._with_found(given)
        if inst == self._configs.get(inst.name) and self.pool.upstreams[inst.name].cfg == inst:
            return  # the same publishers as before: the subscription stands (it sees restarts itself)
        if self.subscriber is not None:
            await self.subscriber.remove_instance(inst.name)
            self.subscriber.add_instance(inst)
        self.pool.upstreams[inst.name].cfg = inst
        self._configs[inst.name] = inst
        if self.subscriber is not None:
            self._sync_fleet()

    async def add(self, inst: InstanceConfig) -> None:
        inst = self._with_found(inst)
        self._configs[inst.name] = inst
        if self.subscriber is not None:
            self.subscriber.add_instance(inst)  # idempotent: a retry after a failure below is safe
            self._sync_fleet()
        await self.pool.add(inst)
        log.info("instance added", extra={"instance": inst.name, "url": inst.url, "events": inst.events})
        if self.on_added:
            self.on_added(inst)

    def update(self, inst: InstanceConfig) -> None:
        inst = self._with_found(inst)
        u = self.pool.upstreams.get(inst.name)
        if u is not None:
            u.cfg = inst
        self._configs[inst.name] = inst
        if self.subscriber is not None:
            self._sync_fleet()
        log.info("instance updated", extra={"instance": inst.name, "weight": inst.weight})

    def drain(self, name: str) -> None:
        self.pool.drain(name)
        log.info("instance draining", extra={"instance": name, "in_flight": self.pool.in_flight(name)})

    def undrain(self, name: str) -> None:
        self.pool.drain(name, draining=False)
        log.info("instance back before its drain ended", extra={"instance": name})

    def in_flight(self, name: str) -> int:
        return self.pool.in_flight(name)

    async def remove(self, name: str) -> None:
        if self.subscriber is not None:
            await self.subscriber.remove_instance(name)  # also Indexer.remove_instance
        else:
            self.indexer.remove_instance(name)
        self.pool.remove(name)
        self._found.pop(name, None)
        inst = self._configs.pop(name, None)
        if self.subscriber is not None:
            self._sync_fleet()
        log.info("instance removed", extra={"instance": name})
        if self.on_removed and inst is not None:
            self.on_removed(inst)

    def _sync_fleet(self) -> None:
        assert self.subscriber is not None
        sub = self.subscriber
        sub.fleet = msgspec.structs.replace(sub.fleet, instances=list(self._configs.values()))
