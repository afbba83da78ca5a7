"""Tiers beyond an instance's GPU: which events feed a shared store, and how a store that announces no
removals is bounded.  Pure: no I/O, no clock (ages are measured on the events' own timestamps).

The fleet file's ``tiers:`` section::

    tiers:
      kv_bytes_per_token: 327680      # the model's KV bytes per token, all GPUs of an instance
      prefill_tokens_per_s: 22000     # one instance's prefill rate: what a cached block saves
      cpu: {load_gbps: 50}            # each instance's own CPU tier (OffloadingConnector, LMCache L1)
      storage: {load_gbps: 7}         # each instance's own STORAGE tier
      shared:                         # stores several instances attach (LMCache remote, Redis, a shared fs)
        - name: l2
          medium: STORAGE             # the events that feed it: this medium ...
          locality: REMOTE            # ... and, when given, this locality and ownership
          instances: [vllm-0, vllm-1] # attached instances (absent: every instance)
          capacity_blocks: 2000000    # what it holds at most
          max_age_s: 3600             # the longest a block is believed without being written again
          load_gbps: 10

An event from instance ``i`` (a ``BlockStored`` of medium ``m``, locality ``l``, ownership ``o``) goes to
the first shared store that ``i`` attaches and whose match fits; any other goes to ``i``'s own tiers.  A
block in a shared store counts for every attached instance.

Stores that announce no removals (vLLM's fs and obj tiers, LMCache's re-emitted pool) would grow without
end in an index; each such store keeps an ``AgeBook``: its blocks in order of their last announcement,
at most ``capacity_blocks`` of them and none older than ``max_age_s`` before the newest announcement seen.
What the book drops, the index drops: an estimate, so the store's trust is ``estimated``.

The valuation fields (``kv_bytes_per_token``, ``prefill_tokens_per_s``, ``load_gbps``) are read by the
router (``kvrouter.routing.tier_value``); their defaults and sources are there.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

import msgspec

from .errors import ConfigError
from .types import Medium, SourceKey

LOCALITIES = ("LOCAL", "REMOTE")
RESERVED = ("GPU", "CPU", "STORAGE")


class LocalTierConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An instance's own offload tier (one per medium)."""

    load_gbps: float | None = None
    """Bandwidth of a load from this tier into the GPU, GB/s per instance (None: the published default
    in ``kvrouter.routing.tier_value``)."""


class SharedStoreConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A store that several instances attach: a block any of them wrote can be loaded by all of them."""

    name: str
    """Its label in lookups, explain and metrics (not GPU, CPU or STORAGE)."""
    medium: str = "STORAGE"
    """The ``medium`` of the events that feed it (CPU for LMCache's re-emitted pool)."""
    locality: str | None = None
    """Only events with this ``locality`` (LOCAL, REMOTE); None: any."""
    ownership: str | None = None
    """Only events with this ``ownership`` (the secondary tier's id); None: any."""
    instances: list[str] | None = None
    """Attached instances; None: every instance of the fleet."""
    announces_removals: bool = False
    """Its BlockRemoved events are trusted to arrive; False (vLLM's fs/obj tiers, LMCache): bounded below."""
    capacity_blocks: int = 0
    """Blocks it holds at most; a store without removals keeps this many most recently written (0: no
    capacity bound, then ``max_age_s`` must bound it)."""
    max_age_s: float = 0.0
    """A block not written again for this long (event time) is taken as gone (0: no age bound)."""
    load_gbps: float | None = None
    """Bandwidth of a load from this store into an instance's GPU, GB/s (None: the published default)."""


class TiersConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    kv_bytes_per_token: int | None = None
    """KV-cache bytes of one token, all GPUs of an instance (None: the default model's)."""
    prefill_tokens_per_s: float | None = None
    """An instance's prefill rate, tokens/s (None: the default model's)."""
    cpu: LocalTierConfig = LocalTierConfig()
    storage: LocalTierConfig = LocalTierConfig()
    shared: list[SharedStoreConfig] = []

    def validate(self, instance_names: Sequence[str]) -> None:
        names = [s.name for s in self.shared]
        if len(set(names)) != len(names):
            raise ConfigError(f"tiers.shared: duplicate store names {sorted(names)}")
        known = set(instance_names)
        for s in self.shared:
            where = f"tiers.shared[{s.name}]"
            if not s.name or s.name.upper() in RESERVED or "@" in s.name:
                raise ConfigError(f"{where}: invalid store name (not GPU, CPU, STORAGE; no '@')")
            try:
                Medium.parse(s.medium)
            except ValueError:
                raise ConfigError(f"{where}: unknown medium {s.medium!r}") from None
            if s.medium.upper() == "GPU":
                raise ConfigError(f"{where}: a shared store's medium is CPU or STORAGE")
            if s.locality is not None and s.locality not in LOCALITIES:
                raise ConfigError(f"{where}: locality must be LOCAL or REMOTE")
            if s.capacity_blocks < 0 or s.max_age_s < 0:
                raise ConfigError(f"{where}: capacity_blocks and max_age_s must be >= 0")
            if not s.announces_removals and not s.capacity_blocks and not s.max_age_s:
                raise ConfigError(
                    f"{where}: a store that announces no removals needs capacity_blocks or max_age_s"
                )
            if s.instances is not None and known:
                unknown = [i for i in s.instances if i not in known]
                if unknown:
                    raise ConfigError(f"{where}: unknown instances {unknown}")
            for bw in (s.load_gbps,):
                if bw is not None and bw <= 0:
                    raise ConfigError(f"{where}: load_gbps must be positive")
        for label, bw in (("cpu", self.cpu.load_gbps), ("storage", self.storage.load_gbps)):
            if bw is not None and bw <= 0:
                raise ConfigError(f"tiers.{label}.load_gbps must be positive")
        if self.kv_bytes_per_token is not None and self.kv_bytes_per_token <= 0:
            raise ConfigError("tiers.kv_bytes_per_token must be positive")
        if self.prefill_tokens_per_s is not None and self.prefill_tokens_per_s <= 0:
            raise ConfigError("tiers.prefill_tokens_per_s must be positive")


def store_source(name: str) -> SourceKey:
    """The index's source for a shared store: rank -1 and an '@' no instance name may hold."""
    return SourceKey(f"@{name}", -1)


def is_store(source: SourceKey) -> bool:
    return source.dp_rank < 0


class SharedStores:
    """The fleet's shared stores: which events feed which store, who attaches it, its age books."""

    def __init__(self, stores: Sequence[SharedStoreConfig] = ()) -> None:
        self.stores = list(stores)
        self.names = [s.name for s in self.stores]
        self.sources = [store_source(s.name) for s in self.stores]
        self.media = [Medium.parse(s.medium) for s in self.stores]
        self.books: list[AgeBook | None] = [
            None if s.announces_removals else AgeBook(s.capacity_blocks, s.max_age_s) for s in self.stores
        ]

    def __len__(self) -> int:
        return len(self.stores)

    def route(self, instance: str, medium: Medium, locality: str | None, ownership: str | None) -> int:
        """The store fed by this event (its position), or -1: the instance's own tier."""
        for i, s in enumerate(self.stores):
            if self.media[i] != medium:
                continue
            if s.instances is not None and instance not in s.instances:
                continue
            if s.locality is not None and s.locality != locality:
                continue
            if s.ownership is not None and s.ownership != ownership:
                continue
            return i
        return -1


class AgeBook:
    """A store's blocks by last announcement (oldest first), bounded by count and by age.

    Invariants: at most ``capacity`` entries (when > 0); after ``announce``, no entry's time is older than
    ``newest - max_age`` (when > 0), ``newest`` being the latest announcement time seen.  Announcement
    times are the events' timestamps and are taken as non-decreasing (engines' clocks; a slightly older
    one is kept as the newest entry anyway, never dropped ahead of its turn).
    """

    def __init__(self, capacity: int, max_age_s: float) -> None:
        self.capacity = capacity
        self.max_age_s = max_age_s
        self.newest = float("-inf")
        self._at: OrderedDict[int, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._at)

    def __contains__(self, chain: int) -> bool:
        return chain in self._at

    def announce(self, chains: Iterable[int], ts: float) -> tuple[list[int], list[int], list[int]]:
        """These blocks were written (again) at ``ts``.  Returns (blocks new to the book, blocks dropped
        for capacity, blocks dropped for age); a block both new and dropped is in neither list."""
        at = self._at
        self.newest = max(self.newest, ts)
        new: dict[int, None] = {}
        for c in chains:
            if c in at:
                at.move_to_end(c)
            else:
                new[c] = None
            at[c] = ts
        aged = self._expire()
        full: list[int] = []
        if self.capacity:
            while len(at) > self.capacity:
                c, _ = at.popitem(last=False)
                full.append(c)
        gone = set(aged) | set(full)
        return (
            [c for c in new if c not in gone],
            [c for c in full if c not in new],
            [c for c in aged if c not in new],
        )

    def _expire(self) -> list[int]:
        if not self.max_age_s or not self._at:
            return []
        cutoff = self.newest - self.max_age_s
        out = []
        at = self._at
        while at:
            c, t = next(iter(at.items()))
            if t >= cutoff:
                break
            at.popitem(last=False)
            out.append(c)
        return out

    def discard(self, chains: Iterable[int]) -> None:
        for c in chains:
            self._at.pop(c, None)

    def clear(self) -> None:
        self._at.clear()
