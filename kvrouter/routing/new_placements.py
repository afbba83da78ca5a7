"""What router replicas tell each other when they place prompts no target holds (``replicas.PrefixClaims``).

A replica about to place a new prompt asks to claim its target.  The answer settles where that prompt goes
(``owner``), or, when other new prompts were placed since the replica last asked (by any replica or
worker process, this one included), lists them (``newer``) and claims nothing: the replica counts them as
expected where they went, decides again and asks again.  So two new prompts placed at about the same time
by two replicas are placed in some order, each knowing of the ones before, as one router would place them.
"""

from __future__ import annotations

import msgspec
import numpy as np

from indexer.hashing import I64Array

from ..types import TargetKey


class NewPlacement(msgspec.Struct, frozen=True):
    """A new prompt placed on ``target``: its block chain hashes (what that target is to hold)."""

    target: TargetKey
    chains: bytes
    """int64 little-endian, as ``encode_chains`` makes them."""

    def chain_array(self) -> I64Array:
        return np.frombuffer(self.chains, dtype="<i8").astype(np.int64)


class ClaimAnswer(msgspec.Struct, frozen=True):
    owner: TargetKey | None = None
    """Where the prompt goes (the asker's own target if its claim was taken, or a live claim's); None when
    ``newer`` is to be weighed first."""
    newer: tuple[NewPlacement, ...] = ()
    """New prompts placed since the asker last asked, oldest first (only when ``owner`` is None)."""


def encode_chains(chains: I64Array) -> bytes:
    return np.ascontiguousarray(chains, dtype="<i8").tobytes()
