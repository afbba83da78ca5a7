"""Membership: instances join and leave the fleet while the router runs.

::

    fleet file ──FleetFileWatcher (poll + hash)──┐
                                                  ├─▶ Reconciler.set_desired(source, instances)
    Kubernetes ──EndpointSliceDiscovery ──────────┤       │ per name: add | update | drain → remove
                 (list-and-watch of a Service's   │       ▼
                  slices)                         │
               ──InferencePoolDiscovery ──────────┘
                 (the pool, and the pods its selector picks)
                                             a ``Membership`` (the seam): the gateway's
                                             ``gateway.fleet_membership`` applies it to its
                                             EventSubscriber · UpstreamPool · Indexer · LoadTracker

| module            | role                                                         | I/O        |
|-------------------|--------------------------------------------------------------|------------|
| model             | diff, merge of sources, the ``Membership`` protocol           | none       |
| kubetypes         | object metadata, list-watch cache                             | none       |
| endpointslices    | EndpointSlice wire types, slice → instances                   | none       |
| inferencepool     | InferencePool wire types, what a pool selects                 | none       |
| pods              | Pod wire types, a pool's pods → instances                     | none       |
| reconcile         | per-name workers driving applied → desired, drains            | asyncio    |
| fleetfile         | fleet-file reload                                             | file       |
| kube              | the Kubernetes client (lightkube): config, resources, calls   | HTTP       |
| listwatch         | one selection kept current: list, watch, relist on 410        | asyncio    |
| discovery         | a Service's instances from its EndpointSlices                 | asyncio    |
| pool_discovery    | an InferencePool's instances from its pods                    | asyncio    |

This package never imports the gateway: ``gateway.membership_runtime`` runs it inside one gateway
(start / stop / state), ``gateway.fleet_membership`` applies its steps, ``gateway.membership_metrics``
exposes its counters.  Tests drive discovery against ``tests/support/fake_apiserver.py``.
"""

from .config import DiscoveryConfig, KubeConnection, MembershipConfig, kube_connection
from .discovery import EndpointSliceDiscovery
from .errors import (
    ApiStatusError,
    ApiUnreachable,
    BadWatchData,
    DiscoveryError,
    FleetReloadError,
    MembershipError,
    ResourceExpired,
)
from .fleetfile import FleetFileWatcher
from .kube import KubeApi
from .model import Membership, MembershipDiff, diff, routing_only
from .pool_discovery import InferencePoolDiscovery
from .reconcile import Reconciler

__all__ = [
    "ApiStatusError",
    "ApiUnreachable",
    "BadWatchData",
    "DiscoveryConfig",
    "DiscoveryError",
    "EndpointSliceDiscovery",
    "FleetFileWatcher",
    "FleetReloadError",
    "InferencePoolDiscovery",
    "KubeApi",
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
