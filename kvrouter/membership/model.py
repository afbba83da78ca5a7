"""The membership model: desired sets of instances, the diff between two of them, and the seam that applies
one (pure: no I/O, no clock).

::

    sources (fleet file, Kubernetes) ──merge──▶ desired {name: InstanceConfig}
    diff(old desired, new desired) ──▶ added / removed / changed            (what the logs and tests see)
    Reconciler: per name, drive applied ──▶ desired through a ``Membership``

An instance is identified by its name.  A change of a routing-only field (``ROUTING_ONLY``) is applied in
place; any other change is a removal followed by an addition, since the name's event sources, replay state
and blocks belong to the old endpoints.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

import msgspec

from indexer.config import FleetConfig, InstanceConfig

ROUTING_ONLY = frozenset({"weight", "models"})
"""Fields that only steer routing: changing them keeps the instance's subscription, blocks and load."""


class MembershipDiff(msgspec.Struct, frozen=True):
    """What changed between two desired sets, each list sorted by name."""

    added: list[InstanceConfig] = []
    """Names present only in the new set."""
    removed: list[InstanceConfig] = []
    """Names present only in the old set (their old config)."""
    changed: list[tuple[InstanceConfig, InstanceConfig]] = []
    """Names in both with different configs: (old, new)."""

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.changed)

    def summary(self) -> dict[str, list[str]]:
        """Names only, for structured logs."""
        return {
            "added": [i.name for i in self.added],
            "removed": [i.name for i in self.removed],
            "changed": [new.name for _, new in self.changed],
        }


def by_name(instances: Iterable[InstanceConfig]) -> dict[str, InstanceConfig]:
    return {i.name: i for i in instances}


def diff(old: Mapping[str, InstanceConfig], new: Mapping[str, InstanceConfig]) -> MembershipDiff:
    """``(old, new) -> (added, removed, changed)`` by instance name."""
    return MembershipDiff(
        added=[new[n] for n in sorted(new.keys() - old.keys())],
        removed=[old[n] for n in sorted(old.keys() - new.keys())],
        changed=[(old[n], new[n]) for n in sorted(old.keys() & new.keys()) if old[n] != new[n]],
    )


def routing_only(old: InstanceConfig, new: InstanceConfig) -> bool:
    """True when ``old`` and ``new`` differ at most in ``ROUTING_ONLY`` fields (same name assumed)."""
    return all(
        getattr(old, f) == getattr(new, f) for f in InstanceConfig.__struct_fields__ if f not in ROUTING_ONLY
    )


def merge_sources(
    sources: Mapping[str, Mapping[str, InstanceConfig]],
) -> tuple[dict[str, InstanceConfig], list[str]]:
    """The union of several sources' instances.  A name claimed by two sources goes to the first source (in
    mapping order); the conflicting names are returned so the caller can count and log them."""
    out: dict[str, InstanceConfig] = {}
    conflicts: list[str] = []
    for insts in sources.values():
        for name, inst in insts.items():
            if name in out:
                if out[name] != inst:
                    conflicts.append(name)
                continue
            out[name] = inst
    return out, conflicts


def sections_changed(old: FleetConfig, new: FleetConfig) -> list[str]:
    """Top-level fleet-file sections other than ``instances`` whose value differs (needing a restart)."""
    return [
        f
        for f in type(old).__struct_fields__
        if f != "instances" and getattr(old, f, None) != getattr(new, f, None)
    ]


class Membership(Protocol):
    """What the ``Reconciler`` drives; ``FleetMembership`` implements it over the gateway's objects.

    The reconciler calls these for one name at a time, never two calls for the same name at once, in the
    orders ``add``; ``update``; ``drain`` [``undrain`` | ``remove``].
    """

    async def add(self, inst: InstanceConfig) -> None:
        """Subscribe to its events (a replay of the engine's buffer follows the connect) and put it in
        rotation once its health check passes.  Must tolerate a retry after a partial failure."""

    def update(self, inst: InstanceConfig) -> None:
        """Take a new config that differs in ``ROUTING_ONLY`` fields only."""

    def drain(self, name: str) -> None:
        """Route no new request to it; requests in flight continue."""

    def undrain(self, name: str) -> None:
        """It is wanted again before its drain ended: back in rotation, nothing was dropped."""

    def in_flight(self, name: str) -> int:
        """Requests routed to it and not finished."""

    async def remove(self, name: str) -> None:
        """After ``drain``: unsubscribe, drop its blocks and its load accounting."""
