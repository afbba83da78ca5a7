"""Every routing policy by name: the one place a policy's name is spelled and checked.

A name in the fleet file, on the command line or in an evaluation spec is a ``PolicyName`` (a ``StrEnum``:
it compares equal to its string, so configs and JSON keep plain strings).  ``policy_name`` turns a string
into one, or raises ``ValueError`` listing the valid names.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from .policies import (
    KvAware,
    LeastLoaded,
    Policy,
    PolicyName,
    PolicySettings,
    PrefixHash,
    Random,
    RoundRobin,
    SessionAffinity,
    SessionTable,
)

ALL_POLICIES: tuple[PolicyName, ...] = tuple(PolicyName)

READS_INDEX = frozenset({PolicyName.KV_AWARE, PolicyName.SESSION})
"""Policies whose ranking reads cached tokens (the index).  The others rank by load, turn or hash alone, so
a simulator may leave the index out of their runs and get the same decisions."""

_FACTORIES: dict[PolicyName, Callable[[PolicySettings, SessionTable], Policy]] = {
    PolicyName.KV_AWARE: lambda s, _: KvAware(s.kv_aware),
    PolicyName.PREFIX_HASH: lambda s, _: PrefixHash(s.prefix_hash),
    PolicyName.LEAST_LOADED: lambda s, _: LeastLoaded(random.Random(s.seed)),
    PolicyName.ROUND_ROBIN: lambda s, _: RoundRobin(),
    PolicyName.RANDOM: lambda s, _: Random(random.Random(s.seed)),
    PolicyName.SESSION: lambda s, t: SessionAffinity(t, KvAware(s.kv_aware)),
}


def policy_name(name: str) -> PolicyName:
    """``name`` as a ``PolicyName``; ``ValueError`` naming the valid ones if it is none of them."""
    try:
        return PolicyName(name)
    except ValueError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(ALL_POLICIES)}") from None


def make_policy(
    name: str, settings: PolicySettings | None = None, sessions: SessionTable | None = None
) -> Policy:
    """``sessions``: the table the session policy reads (the router's, filled on every dispatch)."""
    settings = settings or PolicySettings()
    return _FACTORIES[policy_name(name)](settings, sessions or SessionTable(settings.session))
