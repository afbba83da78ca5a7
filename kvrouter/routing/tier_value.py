"""What a cached block is worth to a request, by the tier it sits in.  Pure: arithmetic on the fleet file.

A block on the instance's GPU is used as it is: worth one block of prefill.  A block in a slower tier
(the instance's own CPU or STORAGE tier, a shared store several instances attach) must first be copied
into the GPU; the copy takes ``kv_bytes_per_token / bandwidth`` per token where recomputing takes
``1 / prefill_tokens_per_s``.  A block's worth is what the copy saves::

    value(tier) = max(0, 1 - load time / recompute time)
                = max(0, 1 - kv_bytes_per_token x prefill_tokens_per_s / load_bytes_per_s)

It does not depend on the block size (both times scale with it).  A tier whose load is slower than
recomputing is worth 0: vLLM would still load it, but the router gives an instance no preference for it.
Speculative entries (the router's own recent dispatches, on their way to the GPU) are worth 1.

Defaults, used for every figure the fleet file leaves out (``tiers:`` in ``indexer.tiers``):

* ``kv_bytes_per_token`` 327,680: Llama-3.1-70B in BF16, 2 (K, V) x 80 layers x 8 KV heads x 128 dims x
  2 bytes (the model's config.json; the simulator's default profile, ``sim.engine.timing``).
* ``prefill_tokens_per_s`` 22,000: that model on 8 x H100 SXM with TP8, the simulator profile's
  calibration on NVIDIA NIM's published TTFT (12.3k prompt tokens/s on 2 x H100; docs.nvidia.com/nim,
  "Benchmarking", Llama-3.3-70B).
* CPU tier 50 GB/s: PCIe 5.0 x16 carries 64 GB/s per direction (PCI-SIG, PCIe 5.0 specification);
  host-to-device copies from pinned memory reach about 50 GB/s of it.
* STORAGE tier 7 GB/s: one PCIe 4.0 x4 NVMe drive's sequential read (datasheets of current drives:
  7.0-7.45 GB/s).
* shared store 12.5 GB/s: the line rate of one 100 Gb/s network link, the usual NIC of a store reached
  over the network (Redis, LMCache's remote server).  A faster fabric (EFA, RDMA) is declared per store.

With these defaults a CPU block is worth 0.86 of a GPU block, a shared-store block 0.42 and an NVMe block
0 (loading 70B's KV from one NVMe drive is slower than recomputing it on eight H100s).
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
