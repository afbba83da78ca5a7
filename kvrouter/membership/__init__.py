"""Membership: instances join and leave the fleet while the router runs.

Sources of instances (``FleetFileWatcher``: poll + hash; ``EndpointSliceDiscovery``: a Service's slices;
``InferencePoolDiscovery``: a pool and the pods its selector picks) feed ``Reconciler.set_desired``, which
drives each name through add | update | drain -> remove on a ``Membership`` (the seam).

model                     diff, merge of sources, the ``Membership`` protocol (pure)
kubetypes, endpointslices, inferencepool, pods: wire types and what they select (pure)
reconcile                 per-name workers driving applied → desired, drains (asyncio)
fleetfile                 fleet-file reload (file)
kube, listwatch           the Kubernetes client (lightkube); list, watch, relist on 410 (HTTP)
discovery, pool_discovery a Service's (EndpointSlices) or a pool's (pods) instances (asyncio)

Invariant: this package never imports the gateway; ``gateway.membership_runtime`` runs it,
``gateway.fleet_membership`` applies its steps, ``gateway.membership_metrics`` exposes its counters.
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
