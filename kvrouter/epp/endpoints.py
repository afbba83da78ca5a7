"""Instances as the gateway names them: ``ip:port`` endpoints, both ways (pure).

The router decides among targets (an instance, or one data-parallel rank of it); the gateway routes to an
endpoint.  Every rank of an instance shares its endpoint (vLLM pins the rank from a request header), so a
ranked list of targets becomes a list of distinct endpoints, best first.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from indexer.config import InstanceConfig

from ..routing import Candidate
from ..types import InstanceId, TargetKey, target_key
from .protocol import Endpoint, endpoint_of_url


class EndpointMap:
    """Endpoint <-> instance for the instances in rotation now (rebuilt from the pool on every request:
    membership changes between requests, and a pool of a few hundred instances costs microseconds)."""

    def __init__(self, instances: Iterable[InstanceConfig]) -> None:
        self.endpoint: dict[InstanceId, Endpoint] = {}
        self.instance: dict[Endpoint, InstanceConfig] = {}
        for inst in instances:
            ep = endpoint_of_url(inst.url)
            if ep is not None:
                self.endpoint[InstanceId(inst.name)] = ep
                self.instance[ep] = inst

    def targets(self, subset: Collection[Endpoint]) -> set[TargetKey]:
        """Every target (each rank) of the instances at the endpoints of ``subset``."""
        out: set[TargetKey] = set()
        for ep in subset:
            inst = self.instance.get(ep)
            if inst is not None:
                out.update(target_key(inst.name, r, inst.dp_size) for r in range(inst.dp_size))
        return out

    def ordered(self, chosen: Candidate, ranked: Iterable[Candidate], limit: int) -> list[Candidate]:
        """``chosen``, then the next-best targets that are not saturated, one per endpoint, at most
        ``limit`` in all.  The request carries one data-parallel rank pin (``chosen``'s), so a fallback
        is a target of that same rank (an instance with one rank ignores the pin)."""
        out = [chosen]
        seen = {self.endpoint.get(chosen.instance)}
        for c in ranked:
            if len(out) >= limit:
                break
            ep = self.endpoint.get(c.instance)
            if ep is None or ep in seen or c.saturated or c.dp_rank != chosen.dp_rank:
                continue
            seen.add(ep)
            out.append(c)
        return out
