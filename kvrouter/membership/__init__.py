"""Membership: instances join and leave the fleet while the router runs.

::

    fleet file ──FleetFileWatcher (poll + hash)──┐
                                                  ├─▶ Reconciler.set_desired(source, instances)
    Kubernetes ──EndpointSliceDiscovery ──────────┘       │ per name: add | update | drain → remove
                 (list-and-watch of a Service's slices)   ▼
                                             a ``Membership`` (the seam): the gateway's
                                             ``gateway.fleet_membership`` applies it to its
                                             EventSubscriber · UpstreamPool · Indexer · LoadTracker

| module            | role                                                         | I/O        |
|-------------------|--------------------------------------------------------------|------------|
| model             | diff, merge of sources, the ``Membership`` protocol           | none       |
| endpointslices    | EndpointSlice wire types, list-watch cache, slice → instances | none       |
| reconcile         | per-name workers driving applied → desired, drains            | asyncio    |
| fleetfile         | fleet-file reload                                             | file       |
| kube, discovery   | list-and-watch client and loop                                | aiohttp    |

This package never imports the gateway: ``gateway.membership_runtime`` runs it inside one gateway
(start / stop / state), ``gateway.fleet_membership`` applies its steps, ``gateway.membership_metrics``
exposes its counters.  Tests drive discovery against ``tests/support/fake_apiserver.py``.
"""

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

__all__ = [
    "ApiStatusError",
    "BadWatchData",
    "DiscoveryConfig",
    "DiscoveryError",
    "EndpointSliceDiscovery",
    "FleetFileWatcher",
    "FleetReloadError",
    "KubeConnection",
    "Membership",
    "MembershipConfig",
    "MembershipDiff",
    "MembershipError",
    "Reconciler",
    "ResourceExpired",
    "diff",
    "kube_connection",
    "routing_only",
]
