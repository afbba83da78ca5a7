"""``MembershipRuntime``: everything membership runs inside one gateway, started and stopped with it.

::

    MembershipRuntime(pool, indexer, subscriber, running config, fleet_path, options, discovery)
      ├─ FleetMembership + Reconciler            (always: the seam and the per-name workers)
      ├─ FleetFileWatcher  → source "fleet"       (options.reload and a fleet_path)
      └─ EndpointSliceDiscovery | InferencePoolDiscovery → "kubernetes"    (a discovery section:
                                                   its ``service`` or its ``pool``)

Both sources may run at once: the desired set is their union, the fleet file winning a name both claim.
Shutdown order: sources first (no new desired sets), then the reconciler (a drain under way is abandoned:
the process is going away with its requests anyway).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from indexer import Indexer
from indexer.config import InstanceConfig
from indexer.subscriber import EventSubscriber

from ..config import RouterFleetConfig, load_router_fleet
from ..membership.config import DiscoveryConfig, KubeConnection, MembershipConfig, kube_connection
from ..membership.discovery import EndpointSliceDiscovery
from ..membership.fleetfile import FleetFileWatcher
from ..membership.kube import KubeApi
from ..membership.pool_discovery import InferencePoolDiscovery
from ..membership.reconcile import Reconciler
from .fleet_membership import FleetMembership
from .upstream import UpstreamPool

FLEET_SOURCE = "fleet"
K8S_SOURCE = "kubernetes"


class MembershipRuntime:
    def __init__(
        self,
        pool: UpstreamPool,
        indexer: Indexer,
        subscriber: EventSubscriber | None,
        running: RouterFleetConfig,
        *,
        fleet_path: str | Path | None = None,
        options: MembershipConfig | None = None,
        discovery: DiscoveryConfig | None = None,
        conn: KubeConnection | None = None,
        on_added: Callable[[InstanceConfig], None] | None = None,
        on_removed: Callable[[InstanceConfig], None] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        """``running``: the config the pool and subscriber were built from.  ``conn``: where the API server
        is (default: resolved from ``discovery`` and the in-cluster environment at ``start``)."""
        options = options or MembershipConfig()
        self.membership = FleetMembership(pool, indexer, subscriber, on_added=on_added, on_removed=on_removed)
        self.reconciler = Reconciler(
            self.membership,
            initial=running.instances,
            initial_source=FLEET_SOURCE,
            drain_timeout_s=options.drain_timeout_s,
        )
        self.watcher: FleetFileWatcher[RouterFleetConfig] | None = None
        if options.reload and fleet_path is not None:
            self.watcher = FleetFileWatcher(
                fleet_path,
                self.reconciler,
                running,
                load=load_router_fleet,
                interval_s=options.reload_interval_s,
                source=FLEET_SOURCE,
            )
        self.discovery_cfg = discovery
        self.conn = conn
        self.discovery: EndpointSliceDiscovery | InferencePoolDiscovery | None = None
        self.kube: KubeApi | None = None
        self._rng = rng

    async def start(self, session: aiohttp.ClientSession) -> None:
        """Raises ``ConfigError`` if discovery is configured but the API server cannot be located."""
        if self.watcher is not None:
            self.watcher.start()
        if self.discovery_cfg is not None:
            d = self.discovery_cfg
            self.kube = KubeApi(self.conn or kube_connection(d))
            kind = EndpointSliceDiscovery if d.service else InferencePoolDiscovery
            self.discovery = kind(d, self.kube, self._on_discovered, rng=self._rng)
            self.discovery.start()

    async def stop(self) -> None:
        if self.watcher is not None:
            await self.watcher.stop()
        if self.discovery is not None:
            await self.discovery.stop()
        if self.kube is not None:
            await self.kube.close()
        await self.reconciler.stop()

    def _on_discovered(self, instances: list[InstanceConfig]) -> None:
        self.reconciler.set_desired(K8S_SOURCE, instances)

    def state(self) -> dict[str, Any]:
        """For /health or an admin endpoint: what is wanted, applied, draining, and the counters."""
        r = self.reconciler
        out: dict[str, Any] = {
            "desired": sorted(r.desired),
            "applied": sorted(r.applied),
            "draining": sorted(r.draining),
            "counters": dict(r.counters),
        }
        if self.watcher is not None:
            w = self.watcher
            out["fleet_file"] = {
                "counters": dict(w.counters),
                "last_error": None if w.last_error is None else str(w.last_error),
                "pending_restart": w.pending_restart,
            }
        if self.discovery is not None:
            out["discovery"] = self.discovery.state()
        return out
