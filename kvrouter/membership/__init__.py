"""Membership: instances join and leave the fleet while the router runs.

::

    fleet file ──FleetFileWatcher (poll + hash)──┐
                                                  ├─▶ Reconciler.set_desired(source, instances)
    Kubernetes ──EndpointSliceDiscovery ──────────┘       │ per name: add | update | drain → remove
                 (list-and-watch of a Service's slices)   ▼
                                             FleetMembership (the ``Membership`` seam)
                                             EventSubscriber · UpstreamPool · Indexer · LoadTracker

| module            | role                                                         | I/O        |
|-------------------|--------------------------------------------------------------|------------|
| model             | diff, merge of sources, the ``Membership`` protocol           | none       |
| endpointslices    | EndpointSlice wire types, list-watch cache, slice → instances | none       |
| reconcile         | per-name workers driving applied → desired, drains            | asyncio    |
| applier           | ``FleetMembership`` over the gateway's objects                | via them   |
| fleetfile         | fleet-file reload                                             | file       |
| kube, discovery   | list-and-watch client and loop                                | aiohttp    |
| metrics           | Prometheus collector over the runtime's counters              | none       |
| runtime           | all of the above inside one gateway: start / stop / state     | —          |
| fake_apiserver    | a faithful fake API server for tests                          | aiohttp    |
"""

from .applier import FleetMembership
from .config import DiscoveryConfig, KubeConnection, MembershipConfig, kube_connection
from .discovery import EndpointSliceDiscovery
from .errors import (
    ApiStatusError,
    BadWatchData,
    DiscoveryError,
    FleetReloadError,
    MembershipError,
    ResourceExpired,
)
from .fleetfile import FleetFileWatcher
from .model import Membership, MembershipDiff, diff, routing_only
from .reconcile import Reconciler
from .runtime import MembershipRuntime

__all__ = [
    "ApiStatusError",
    "BadWatchData",
    "DiscoveryConfig",
    "DiscoveryError",
    "EndpointSliceDiscovery",
    "FleetFileWatcher",
    "FleetMembership",
    "FleetReloadError",
    "KubeConnection",
    "Membership",
    "MembershipConfig",
    "MembershipDiff",
    "MembershipError",
    "MembershipRuntime",
    "Reconciler",
    "ResourceExpired",
    "diff",
    "kube_connection",
    "routing_only",
]
