"""The identities every part of kvrouter names: one declaration each.

``InstanceId`` is the indexer's (an instance's name in the fleet file), and ``Role`` (an instance's job in a
disaggregated fleet) the fleet file's; the others are the router's.  The
indexer's hash types (``EngineHash``, ``ChainHash``) and ``SourceKey`` stay in ``indexer.types``: the
router never makes one of its own.
"""

from __future__ import annotations

from typing import NewType

from indexer.config import Role
from indexer.types import InstanceId

__all__ = ["InstanceId", "RequestId", "Role", "TargetKey", "leg_id", "target_key"]

RequestId = NewType("RequestId", str)
"""One request's id: the router's (unique per router process), or the one a client gave the simulator."""

TargetKey = NewType("TargetKey", str)
"""A routable (instance, data-parallel rank): ``instance``, or ``instance/rank`` when the instance has
several ranks.  The key of load accounting, of the hash rings and of per-target metrics."""


def target_key(instance: str, dp_rank: int, dp_size: int) -> TargetKey:
    """The key of one rank of an instance (the instance's name alone when it has one rank)."""
    return TargetKey(instance if dp_size == 1 else f"{instance}/{dp_rank}")


def leg_id(request_id: RequestId) -> RequestId:
    """The id under which the prefill leg of a disaggregated request is accounted (its decode leg, like a
    whole request, under ``request_id`` itself): two loads on two instances, one request."""
    return RequestId(f"{request_id}:prefill")
