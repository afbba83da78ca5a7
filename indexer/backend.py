"""The index seam: what ``Indexer`` and the router need from a block index, whatever stores it.

::

                      ┌── BlockIndex        in process (cykhash maps), one owner, ~µs per call
    Indexer ──index──▶┤
                      └── RedisBlockIndex   in Redis (Lua scripts), shared by ingesting indexers and
                                            stateless routers, one round trip per call

Both pass one behaviour suite (``tests/test_redis_index_contract.py``), including a stateful test against
a plain reference model.  Metrics belong in a wrapper around a backend, never inside one.

Contract, for every backend:

* ``store`` adds one reference per (source, chain, medium); ``remove`` drops one per engine hash and
  returns how many hashes the source did not hold in that medium.  A source holds a chain in a medium
  while its references there are > 0; its engine hash resolves (``engine_chain``) while it holds the chain
  in some medium.
* ``match(chains)`` returns, for each source holding at least the first block, how many leading blocks it
  holds (holes end a match), each counted once in its best tier: GPU, CPU, STORAGE, speculative.
* Speculative entries count as held until a ``store`` of the same chain by the same source confirms them,
  the source is cleared, or ``expire(now)`` passes their expiry.  ``now`` is the caller's clock; a backend
  shared between processes maps it onto a shared clock.
* ``clear_source`` forgets a source's blocks but keeps it listed; ``drop_source`` forgets it entirely.
"""

from __future__ import annotations

from typing import Protocol

from .hashing import I64Array
from .index import SourceMatch
from .types import ChainHash, Medium, SourceKey


class IndexBackend(Protocol):
    """A block index: per-source chain-hash membership per medium, plus speculative entries."""

    # ------------------------------------------------------------------ writes
    def store(self, source: SourceKey, engine_hashes: I64Array, chains: I64Array, medium: Medium) -> None:
        """The source holds these blocks in ``medium`` (``engine_hashes[i]`` is vLLM's id of ``chains[i]``).
        Raises ``SourceOverCapacity`` beyond the per-source cap."""
        ...

    def remove(self, source: SourceKey, engine_hashes: I64Array, medium: Medium) -> int:
        """Drop one reference per engine hash; returns how many were not held (already gone)."""
        ...

    def clear_source(self, source: SourceKey) -> None: ...

    def drop_source(self, source: SourceKey) -> None: ...

    def add_speculative(self, source: SourceKey, chains: I64Array, *, now: float, ttl: float) -> None:
        """These blocks were just sent to ``source``: count them as held until confirmed or expired."""
        ...

    def expire(self, now: float) -> None:
        """Speculative entries whose expiry is <= ``now`` no longer count."""
        ...

    # ------------------------------------------------------------------ reads
    def match(self, chains: I64Array) -> list[SourceMatch]:
        """Matched leading blocks per source, for sources matching at least one block (any order)."""
        ...

    def held_by_any(self, chain_hash: int) -> bool:
        """Whether any source may hold this block (a hint: it may err towards True, never towards False)."""
        ...

    def engine_chain(self, source: SourceKey, engine_hash: int) -> ChainHash | None: ...

    def sources(self) -> list[SourceKey]: ...

    def blocks(self, source: SourceKey) -> dict[Medium, int]:
        """Distinct chains the source holds, per medium."""
        ...

    def total_entries(self) -> int:
        """(source, block, medium) entries held."""
        ...

    def speculative_entries(self) -> int: ...
