"""Shared stores in the index: blocks written for a store, bounded by its age book, counted per store.

::

    BlockStored(medium m, locality, ownership) from instance i ──SharedStores.route──▶ store s
        s announces removals:  index[store s] holds (i's engine hash -> chain), one reference per write
        s announces none:      AgeBook(s).announce ──new──▶ index[store s] (engine hash = chain)
                                                   ──dropped (capacity, age)──▶ removed from index[store s]

Each store is a source of its own in the index (``tiers.store_source``), never reported by lookups; the
walk credits its blocks to the attached instances.  Pure: time is the events' timestamps.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from .hashing import I64Array
from .index import BlockIndex
from .tiers import SharedStores
from .types import Medium, SourceKey, Trust


class StoreWriter:
    """Owns the stores' age books and their writes into the index (one owner, as the index)."""

    def __init__(self, index: BlockIndex, stores: SharedStores) -> None:
        self.index = index
        self.stores = stores
        self.drops: Counter[str] = Counter()
        """Blocks the age books dropped, by ``<store>:capacity`` / ``<store>:age``."""
        index.set_shared(
            [
                (src, None if cfg.instances is None else frozenset(cfg.instances))
                for src, cfg in zip(stores.sources, stores.stores)
            ]
        )

    def __len__(self) -> int:
        return len(self.stores)

    def trust(self, store: int) -> Trust:
        """Stores without removals are estimates; the others are as good as the streams that feed them,
        which the attached instances' own trust reports."""
        return Trust.ESTIMATED if self.stores.books[store] is not None else Trust.EXACT

    def write(self, store: int, engines: I64Array, chains: I64Array, ts: float) -> int:
        """Blocks written to ``store`` at event time ``ts``; returns how many the index now holds anew."""
        src, medium = self.stores.sources[store], self.stores.media[store]
        book = self.stores.books[store]
        if book is None:
            self.index.store(src, engines, chains, medium)
            return len(chains)
        new, full, aged = book.announce(chains.tolist(), ts)
        self._drop(store, full, "capacity")
        self._drop(store, aged, "age")
        if new:
            arr = np.array(new, dtype=np.int64)
            self.index.store(src, arr, arr, medium)  # the chain is its own id: no removal names it
        return len(new)

    def age(self, ts: float) -> None:
        """An event at ``ts`` from any source: entries older than each store's age bound before it go."""
        for i, book in enumerate(self.stores.books):
            if book is not None and book.max_age_s and ts > book.newest:
                _, full, aged = book.announce((), ts)
                self._drop(i, full, "capacity")
                self._drop(i, aged, "age")

    def remove(self, store: int, engines: I64Array, chains: I64Array) -> int:
        """A removal announced for ``store``: by the announcing engine hashes when the store keeps them,
        else by chain.  Returns how many were unknown."""
        src, medium = self.stores.sources[store], self.stores.media[store]
        book = self.stores.books[store]
        if book is None:
            return self.index.remove(src, engines, medium)
        known = [c for c in chains.tolist() if c in book]
        book.discard(known)
        if known:
            self.index.remove(src, np.array(known, dtype=np.int64), medium)
        return len(engines) - len(known)

    def engine_chain(self, store: int, engine_hash: int) -> int | None:
        """A store that keeps its writers' engine hashes resolves them (a child's parent, a placeholder)."""
        if self.stores.books[store] is not None:
            return None
        return self.index.engine_chain(self.stores.sources[store], engine_hash)

    def _drop(self, store: int, chains: list[int], why: str) -> None:
        if not chains:
            return
        src, medium = self.stores.sources[store], self.stores.media[store]
        self.index.remove(src, np.array(chains, dtype=np.int64), medium)
        self.drops[f"{self.stores.names[store]}:{why}"] += len(chains)

    def blocks(self) -> dict[str, int]:
        """Blocks each store holds in the index."""
        return {
            n: self.index.blocks(src)[m]
            for n, src, m in zip(self.stores.names, self.stores.sources, self.stores.media)
        }

    def is_store(self, source: SourceKey) -> bool:
        return source in self.stores.sources

    def media(self, store: int) -> Medium:
        return self.stores.media[store]
