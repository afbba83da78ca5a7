"""``indexer.reserve_blocks_per_source`` in the fleet file: the index built for the fleet
(``Indexer.for_fleet``, what ``kvrouter serve`` and ``kvrouter indexer`` build) has its tables sized for
every listed (instance, rank), so filling each source to its declared capacity never rehashes a table;
without it, the same stores grow them.  Answers are the same either way."""

from __future__ import annotations

import random
from typing import Any

import pytest

from indexer import ConfigError, Indexer
from indexer.config import FleetConfig, parse_fleet
from indexer.encode import PayloadEncoder
from indexer.index import BlockIndex

BS = 4
PER_SOURCE = 3000
ENC = PayloadEncoder("0.33.0")


def fleet(**indexer: Any) -> FleetConfig:
    obj = {
        "block_size": BS,
        "instances": [{"name": "a"}, {"name": "b", "dp_size": 2}],
        "indexer": indexer,
    }
    return parse_fleet(obj, FleetConfig)


def tables(ix: Indexer) -> list[int]:
    """Identities of the index's hash tables, the chain table's buckets and each source's engine table (a
    growth rehashes one into a new array).  The side rows of offloaded blocks are a plain array that grows
    by copying, and GPU-only stores take none."""
    assert isinstance(ix.index, BlockIndex)
    return [id(ix.index._chains.R)] + [id(e.E) for e in ix.index._engine if e is not None]


def fill(ix: Indexer, rnd: random.Random) -> list[list[int]]:
    """Each of the three sources stores PER_SOURCE blocks in sequences of 100; returns the prompts."""
    prompts = []
    for inst, rank in (("a", 0), ("b", 0), ("b", 1)):
        for s in range(PER_SOURCE // 100):
            toks = [rnd.randrange(50_000) for _ in range(100 * BS)]
            engines = [rnd.getrandbits(63) for _ in range(100)]
            ix.apply_payload(inst, ENC.batch([ENC.stored(engines, None, toks, BS)], ts=1.0, dp_rank=rank))
            if s == 0:
                prompts.append(toks)
    return prompts


def test_a_reserved_fleet_never_grows_its_tables() -> None:
    reserved = Indexer.for_fleet(fleet(reserve_blocks_per_source=PER_SOURCE))
    grown = Indexer.for_fleet(fleet())
    # The first store of each source allocates its engine table (sized ahead for a reserved fleet).
    for ix in (reserved, grown):
        ix.apply_payload("a", ENC.batch([ENC.stored([1], None, [1, 2, 3, 4], BS)], ts=1.0))
        ix.apply_payload("b", ENC.batch([ENC.stored([2], None, [1, 2, 3, 5], BS)], ts=1.0, dp_rank=0))
        ix.apply_payload("b", ENC.batch([ENC.stored([3], None, [1, 2, 3, 6], BS)], ts=1.0, dp_rank=1))
    before = tables(reserved)
    grown_before = tables(grown)
    prompts = fill(reserved, random.Random(7))
    assert fill(grown, random.Random(7)) == prompts
    assert tables(reserved) == before  # not one table rehashed
    assert tables(grown) != grown_before  # the same stores outgrew the unreserved tables
    for toks in prompts:
        assert reserved.lookup(toks) == grown.lookup(toks)
        assert max(m.matched_blocks for m in reserved.lookup(toks).instances) == 100


def test_a_router_with_a_remote_index_reserves_nothing() -> None:
    cfg = fleet(reserve_blocks_per_source=200_000)
    assert isinstance(Indexer.for_fleet(cfg).index, BlockIndex)
    big = Indexer.for_fleet(cfg).index.nbytes()  # type: ignore[union-attr]
    small = Indexer.for_fleet(cfg, reserve=False).index.nbytes()  # type: ignore[union-attr]
    assert big > 3 * 200_000 * 8 > small


@pytest.mark.parametrize("value", [-1, 9_000_000])
def test_the_reserve_is_checked_against_the_cap(value: int) -> None:
    with pytest.raises(ConfigError, match="reserve_blocks_per_source"):
        fleet(reserve_blocks_per_source=value)
