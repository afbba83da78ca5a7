"""What a cached block is worth to a request, by the tier it sits in.  Pure: arithmetic on the fleet file.

A block on the instance's GPU is worth one block of prefill.  A block in a slower tier (the instance's
own CPU or STORAGE tier, a shared store) must first be copied into the GPU, at
``kv_bytes_per_token / bandwidth`` per token where recomputing takes ``1 / prefill_tokens_per_s``::

    value(tier) = max(0, 1 - load time / recompute time)
                = max(0, 1 - kv_bytes_per_token x prefill_tokens_per_s / load_bytes_per_s)

It does not depend on the block size (both times scale with it).  A tier slower than recomputing is
worth 0: vLLM would still load it, but the router gives no preference for it.  Speculative entries (the
router's own recent dispatches, on their way to the GPU) are worth 1.  Defaults fill every figure the
fleet file leaves out (``tiers:``, ``indexer.tiers``); their sources and the worths they give are in
docs/measurements.md, "Tier values".
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import msgspec

from indexer.tiers import TiersConfig

DEFAULT_KV_BYTES_PER_TOKEN = 327_680
DEFAULT_PREFILL_TOKENS_PER_S = 22_000.0
DEFAULT_CPU_GBPS = 50.0
DEFAULT_STORAGE_GBPS = 7.0
DEFAULT_SHARED_GBPS = 12.5

GPU = "GPU"
SPECULATIVE = "speculative"


def load_ratio(kv_bytes_per_token: float, prefill_tokens_per_s: float, gbps: float) -> float:
    """Load time over recompute time of the same tokens (below 1: loading is faster)."""
    return kv_bytes_per_token * prefill_tokens_per_s / (gbps * 1e9)


def block_value(ratio: float) -> float:
    return max(0.0, 1.0 - ratio)


class TierValues(msgspec.Struct, frozen=True):
    """Worth of one cached block per tier, relative to a GPU block (1.0), and the figures behind it.

    Tier names are the index's: ``GPU``, ``CPU``, ``STORAGE``, a shared store's name, and ``speculative``
    for the router's own entries.  A tier not listed (a store the router's fleet file does not declare) is
    worth ``shared_default``."""

    cpu: float
    storage: float
    shared: dict[str, float] = {}
    shared_default: float = 0.0
    load_ms_per_1k_tokens: dict[str, float] = {}
    """Per tier: milliseconds to load a thousand tokens' KV (explain shows it beside the value)."""
    recompute_ms_per_1k_tokens: float = 0.0

    def of(self, tier: str) -> float:
        if tier in (GPU, SPECULATIVE):
            return 1.0
        if tier == "CPU":
            return self.cpu
        if tier == "STORAGE":
            return self.storage
        return self.shared.get(tier, self.shared_default)

    def flat(self, value: float) -> TierValues:
        """The same tiers, every one below the GPU at ``value`` (the fleet file's ``offload_value``)."""
        return msgspec.structs.replace(
            self,
            cpu=value,
            storage=value,
            shared={k: value for k in self.shared},
            shared_default=value,
        )


def tier_values(cfg: TiersConfig | None = None) -> TierValues:
    """Each tier's worth from the fleet file's ``tiers:`` section (defaults above for what it leaves out)."""
    cfg = cfg or TiersConfig()
    kvb = cfg.kv_bytes_per_token or DEFAULT_KV_BYTES_PER_TOKEN
    rate = cfg.prefill_tokens_per_s or DEFAULT_PREFILL_TOKENS_PER_S
    bw = {
        "CPU": cfg.cpu.load_gbps or DEFAULT_CPU_GBPS,
        "STORAGE": cfg.storage.load_gbps or DEFAULT_STORAGE_GBPS,
    }
    for s in cfg.shared:
        bw[s.name] = s.load_gbps or DEFAULT_SHARED_GBPS
    value = {t: block_value(load_ratio(kvb, rate, g)) for t, g in bw.items()}
    return TierValues(
        cpu=value.pop("CPU"),
        storage=value.pop("STORAGE"),
        shared=value,
        shared_default=block_value(load_ratio(kvb, rate, DEFAULT_SHARED_GBPS)),
        load_ms_per_1k_tokens={t: 1e3 * 1e3 * kvb / (g * 1e9) for t, g in bw.items()},
        recompute_ms_per_1k_tokens=1e3 * 1e3 / rate,
    )


DEFAULT_TIER_VALUES = tier_values()

_FIRST = (GPU, SPECULATIVE, "CPU", "STORAGE")
OWN_TIERS = frozenset((GPU, "CPU", "STORAGE"))
"""The tiers an instance's own events describe (any other name in a lookup's tiers is a shared store)."""


def credited_split(
    tiers: Mapping[str, int], speculative: int, max_hit: int, unusable: Collection[str] = ()
) -> dict[str, int]:
    """A lookup's matched blocks by tier (the index's ``InstanceMatch.tiers`` plus the speculative
    count), as the router credits them: at most ``max_hit`` blocks (vLLM computes the last prompt token
    whatever it caches), cut from the slowest tiers first (GPU, speculative, CPU, STORAGE, then shared
    stores in the index's order); blocks of a store in ``unusable`` (its trust is too low) not at all.
    Tiers credited 0 blocks are left out."""
    if not speculative and (not tiers or (len(tiers) == 1 and GPU in tiers)):
        # Most targets of most lookups: blocks on the GPU alone, or none (the same answer as below, without
        # building the order: this runs once per candidate of every decision).
        take = min(max(0, tiers[GPU]), max(0, max_hit)) if tiers else 0
        return {GPU: take} if take else {}
    order = [(GPU, tiers.get(GPU, 0)), (SPECULATIVE, speculative)]
    order += [(k, tiers.get(k, 0)) for k in _FIRST[2:]]
    order += [(k, n) for k, n in tiers.items() if k not in _FIRST and k not in unusable]
    out: dict[str, int] = {}
    room = max(0, max_hit)
    for k, n in order:
        take = min(max(0, n), room)
        if take:
            out[k] = take
            room -= take
    return out
