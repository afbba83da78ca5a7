"""Literal unit tests of the simulated KV pool: tiny pools, tiny hashes, every vLLM rule spelled out."""

from __future__ import annotations

import pytest

from kvrouter.lab.sim.engine.blockpool import BlockPool
from kvrouter.lab.sim.engine.events import AllBlocksCleared, BlockRemoved
from kvrouter.lab.sim.engine.types import BlockHash, BlockId


def H(*xs: int) -> list[BlockHash]:
    return [BlockHash(x) for x in xs]


def B(*xs: int) -> list[BlockId]:
    return [BlockId(x) for x in xs]


def test_allocation_pops_in_block_order_and_counts_usage() -> None:
    pool = BlockPool(4)
    assert pool.get_new_blocks(3) == B(0, 1, 2)
    assert pool.num_free == 1
    assert pool.usage() == pytest.approx(0.75)
    pool.check()


def test_hit_takes_a_reference_and_emits_nothing() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    pool.cache_blocks(blocks, H(11, 12))
    pool.free_blocks(reversed(blocks))
    assert pool.longest_hit(H(11, 12, 13), 3) == B(0, 1)
    assert pool.longest_hit(H(11, 12), 1) == B(0)  # capped
    assert pool.longest_hit(H(99, 12), 5) == []  # a miss ends the run
    pool.touch(B(0, 1))
    assert pool.num_free == 2 and pool.take_events() == []
    pool.check()


def test_free_puts_fresh_first_and_cached_tail_first() -> None:
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)  # 0 1 2: blocks 0,1 full, 2 partial
    pool.cache_blocks(a[:2], H(1, 2))
    pool.free_blocks(reversed(a))  # eviction order: 2 (fresh), 1, 0
    # head: fresh block 2, then the never-used 3 4 5, then cached 1 (tail block) before 0
    assert pool.free_order() == B(2, 3, 4, 5, 1, 0)
    pool.check()


def test_eviction_is_lru_one_removed_event_per_block() -> None:
    pool = BlockPool(3)
    x = pool.get_new_blocks(1)
    pool.cache_blocks(x, H(7))
    pool.free_blocks(x)
    y = pool.get_new_blocks(2)
    pool.cache_blocks(y, H(8, 9))
    pool.free_blocks(reversed(y))  # queue: 0(h7) 2(h9) 1(h8)
    assert pool.free_order() == B(0, 2, 1)
    pool.take_events()
    got = pool.get_new_blocks(2)
    assert got == B(0, 2)
    assert pool.take_events() == [BlockRemoved(H(7)), BlockRemoved(H(9))]
    assert pool.cached_hashes() == {8}
    pool.check()


def test_duplicates_are_kept_and_evicted_one_by_one() -> None:
    pool = BlockPool(4)
    a = pool.get_new_blocks(1)
    b = pool.get_new_blocks(1)
    pool.cache_blocks(a, H(5))
    pool.cache_blocks(b, H(5))  # same hash computed twice: no de-duplication
    assert pool.num_cached_blocks() == 2
    assert pool.longest_hit(H(5), 1) == a  # the first one cached
    pool.free_blocks(a + b)
    pool.take_events()
    pool.get_new_blocks(3)  # blocks 2 3 then 0: evicts one copy
    assert pool.take_events() == [BlockRemoved(H(5))]
    assert pool.is_cached(BlockHash(5)) and pool.longest_hit(H(5), 1) == b
    pool.check()


def test_a_hit_on_a_free_block_protects_it_from_eviction() -> None:
    pool = BlockPool(2)
    a = pool.get_new_blocks(1)
    pool.cache_blocks(a, H(3))
    pool.free_blocks(a)
    pool.touch(a)
    assert pool.get_new_blocks(1) == B(1)
    assert pool.num_free == 0 and pool.take_events() == []


def test_reset_needs_every_block_free_and_emits_one_clear() -> None:
    pool = BlockPool(2)
    a = pool.get_new_blocks(1)
    pool.cache_blocks(a, H(4))
    assert pool.reset() is False
    pool.free_blocks(a)
    assert pool.reset() is True
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.cached_hashes() == set()
    assert pool.get_new_blocks(2) == B(1, 0) and pool.take_events() == []  # nothing left to remove


def test_caching_disabled_keeps_no_hashes() -> None:
    pool = BlockPool(2, enable_caching=False)
    a = pool.get_new_blocks(1)
    pool.cache_blocks(a, H(4))
    assert pool.longest_hit(H(4), 1) == [] and pool.cached_hashes() == set()
