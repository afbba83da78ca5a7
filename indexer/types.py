"""Named types of the indexer's domain.

Two kinds of block hash exist and must never be confused:

* ``EngineHash``: vLLM's own block hash as sent in events, normalised to an unsigned 64-bit int.  It is an
  opaque id, valid only within one source (its algorithm and seed are vLLM's business).
* ``ChainHash``: kvrouter's own chained hash of a block and everything before it (token ids plus the keys
  that change vLLM's cache key: LoRA name, ``cache_salt``).  Requests and events meet on this hash.  It is
  a signed 64-bit int so that it fits numpy ``int64`` and the cykhash maps without conversion.
"""

from __future__ import annotations

import enum
from typing import NamedTuple, NewType

EngineHash = NewType("EngineHash", int)
"""vLLM's block hash, normalised to 0 <= h < 2**64."""

ChainHash = NewType("ChainHash", int)
"""kvrouter's chained block hash, -2**63 <= h < 2**63."""

InstanceId = NewType("InstanceId", str)
"""The name of a vLLM instance as given in the fleet file (or in the topic, in bind mode)."""


class SourceKey(NamedTuple):
    """One event publisher: an instance and its data-parallel rank.  Each has its own sequence."""

    instance: str
    dp_rank: int

    def label(self) -> str:
        return f"{self.instance}/{self.dp_rank}"


class Medium(enum.IntEnum):
    """Where a cached block lives.  vLLM sends ``None`` for GPU."""

    GPU = 0
    CPU = 1
    STORAGE = 2

    @classmethod
    def parse(cls, name: str | None) -> Medium:
        if name is None:
            return cls.GPU
        try:
            return cls[name.upper()]
        except KeyError:
            raise ValueError(f"unknown medium {name!r}") from None


class Trust(enum.Enum):
    """How far the index can be believed for one source.

    * ``exact``: every batch since the engine started was applied in order.
    * ``partial``: history before the indexer joined is missing (no replay, or the replay buffer did not reach
      back to seq 0), but nothing was lost since: what the index holds is real, it may hold too little.
    * ``estimated``: a shared store that announces no removals (``indexer.tiers``): what it holds is bounded
      by the capacity and age the fleet file declares, so it may claim blocks the store already dropped.
      Below ``partial`` (which never claims too much), above ``degraded`` (which may claim without bound).
    * ``degraded``: a batch was lost mid-stream and replay could not fill the gap: removals may have been
      missed, so the index may claim blocks the engine no longer has.  Routers fall back for this source.
    * ``cold``: no event seen yet (or the source never connected).
    """

    EXACT = "exact"
    PARTIAL = "partial"
    ESTIMATED = "estimated"
    DEGRADED = "degraded"
    COLD = "cold"

    @property
    def usable(self) -> bool:
        """Whether a router may route on this source's matches."""
        return self in (Trust.EXACT, Trust.PARTIAL, Trust.ESTIMATED)
