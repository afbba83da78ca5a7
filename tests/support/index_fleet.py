"""Small fleets for the indexer's socket tests: a fleet config, one stored sequence per batch, a lookup."""

from __future__ import annotations

from indexer import Indexer
from indexer.config import FleetConfig, IndexerOptions, InstanceConfig
from kvrouter.lab.sim.engine.events import BlockStored

BS = 16


def seq_event(k: int) -> tuple[BlockStored, list[int]]:
    """Batch k stores a 2-block sequence of its own (tokens k*1000 ...)."""
    toks = list(range(k * 1000 + 1, k * 1000 + 1 + 2 * BS))
    return BlockStored([k * 10 + 1, k * 10 + 2], None, toks, BS), toks


def fleet(instances: list[InstanceConfig], **kw: object) -> FleetConfig:
    opts = IndexerOptions(replay_timeout_s=1.0)
    return FleetConfig(block_size=BS, instances=instances, indexer=opts, **kw)  # type: ignore[arg-type]


def held(ix: Indexer, inst: str, toks: list[int], rank: int = 0) -> int:
    m = [x for x in ix.lookup(toks).instances if (x.instance, x.dp_rank) == (inst, rank)]
    return m[0].matched_blocks if m else 0
