"""What a simulated fleet's file says about its tiers (``indexer.tiers``), from the timing profile: the
router values each tier from the same figures the simulator charges."""

from __future__ import annotations

from indexer.tiers import LocalTierConfig, SharedStoreConfig, TiersConfig
from kvrouter.lab.sim.engine.timing import TimingProfile

L2_NAME = "l2"
"""The simulated fleets' shared store, as their fleet files declare it."""


def tiers_config(profile: TimingProfile, l2_blocks: int = 0, l2_gbps: float = 12.5) -> TiersConfig:
    """What a simulated fleet's file says about its tiers (``indexer.tiers``): the profile's KV bytes per
    token and prefill rate (linear FLOPs at its fitted utilisation), its host link for the CPU tier, and
    the L2 (when ``l2_blocks``) as a store every instance attaches, bounded by its capacity since it
    announces no removals."""
    rate = profile.num_gpus * profile.peak_flops * profile.mfu / profile.flops_per_token
    shared = (
        [SharedStoreConfig(L2_NAME, medium="STORAGE", capacity_blocks=l2_blocks, load_gbps=l2_gbps)]
        if l2_blocks
        else []
    )
    return TiersConfig(
        kv_bytes_per_token=profile.kv_bytes_per_token,
        prefill_tokens_per_s=rate,
        cpu=LocalTierConfig(load_gbps=profile.cpu_load_bytes_per_s / 1e9),
        shared=shared,
    )
