"""Prefill that other router replicas sent to each target and that is not done yet, judged by the events.

::

    a peer's speculative entry (blocks its request must compute there) ──add──▶ entries per source,
                                                                                 and their distinct chains
    before a decision: tokens(source, now, indexer) ──▶ block_size x distinct chains of the live entries
        the router charges a target the smaller of this and the peers' reported prefill

Invariant: ``tokens`` is ``block_size`` x the number of distinct chains over the source's live entries,
where an entry is live from ``add`` until a ``tokens`` call finds its last chain stored there or its
expiry passed (found stored once, it stays done: a block stored and evicted again was computed).  The
KV events every replica takes in say when the blocks are stored, at about the same moment everywhere,
so this view ends with the work; a peer's reported figure is a round trip old (why that matters:
docs/replicas.md).
"""

from __future__ import annotations

import msgspec
import numpy as np

from indexer import Indexer, SourceKey
from indexer.hashing import I64Array
from indexer.index import STORED_BITS


class _Entry(msgspec.Struct, gc=False):
    last: int
    """The chain of the entry's last block: stored at its target, the request has computed them all."""
    chains: list[int]
    expiry: float


class PeerPrefill:
    """Per source: the entries other replicas sent there that the events do not show done yet."""

    def __init__(self, block_size: int, *, max_entries: int = 10_000) -> None:
        """``max_entries``: entries kept per source at most (the oldest go first)."""
        if block_size <= 0 or max_entries <= 0:
            raise ValueError("block_size and max_entries must be positive")
        self.block_size = block_size
        self.max_entries = max_entries
        self._entries: dict[SourceKey, list[_Entry]] = {}
        self._refs: dict[SourceKey, dict[int, int]] = {}
        """Per source: chain -> live entries listing it (the distinct chains are the keys)."""

    def add(self, source: SourceKey, chains: I64Array, *, expiry: float, now: float) -> None:
        """A peer sent a request whose blocks ``chains`` (in prompt order) no target held to ``source``."""
        if not len(chains) or expiry <= now:
            return
        es = self._entries.setdefault(source, [])
        refs = self._refs.setdefault(source, {})
        listed = [int(c) for c in chains]
        es.append(_Entry(listed[-1], listed, expiry))
        for c in listed:
            refs[c] = refs.get(c, 0) + 1
        if len(es) > self.max_entries or any(e.expiry <= now for e in es):
            self._keep(source, [e for e in es[-self.max_entries :] if e.expiry > now])

    def tokens(self, source: SourceKey, now: float | None, indexer: Indexer) -> int:
        """Prompt tokens peers' requests still have to compute at ``source`` (``now`` None: none expire)."""
        es = self._entries.get(source)
        if not es:
            return 0
        held = indexer.holding(source, np.fromiter((e.last for e in es), dtype=np.int64, count=len(es)))
        done = [False] * len(es) if held is None else ((held & STORED_BITS) != 0).tolist()
        if any(done) or (now is not None and min(e.expiry for e in es) <= now):
            self._keep(source, [e for e, d in zip(es, done) if not d and (now is None or e.expiry > now)])
        return self.block_size * len(self._refs.get(source, ()))

    def _keep(self, source: SourceKey, keep: list[_Entry]) -> None:
        es, refs = self._entries[source], self._refs[source]
        kept = {id(e) for e in keep}
        for e in es:
            if id(e) in kept:
                continue
            for c in e.chains:
                n = refs[c] - 1
                if n:
                    refs[c] = n
                else:
                    del refs[c]
        if keep:
            self._entries[source] = keep
        else:
            del self._entries[source]
            del self._refs[source]

    def entries(self) -> int:
        return sum(len(es) for es in self._entries.values())

    def clear(self) -> None:
        self._entries.clear()
        self._refs.clear()
