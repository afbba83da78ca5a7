"""Tiers in the indexer, literal cases with tiny hashes: shared stores credited to attached instances
only, their trust, placeholders counted, REMOTE blocks no store takes, an offload child before its parent,
the fleet file's ``tiers:`` section checked, snapshots without the stores' estimates."""

from __future__ import annotations

import pytest

from indexer import ConfigError, Indexer, SourceKey
from indexer.config import FleetConfig, parse_fleet
from indexer.encode import PayloadEncoder
from indexer.tiers import SharedStoreConfig, TiersConfig

BS = 4
T = list(range(1, 17))  # four blocks
E = PayloadEncoder("0.33.0")
L2 = SharedStoreConfig("l2", medium="STORAGE", instances=["a", "b"], capacity_blocks=3)


def gpu(
    ix: Indexer, inst: str, hashes: list[int], toks: list[int], parent: int | None = None, ts: float = 1.0
) -> None:
    ix.apply_payload(inst, E.batch([E.stored(hashes, parent, toks, BS)], ts=ts))


def storage(
    ix: Indexer, inst: str, hashes: list[int], *, locality: str | None = None, ts: float = 1.0
) -> None:
    """vLLM's fs tier as the OffloadingConnector announces it: one placeholder per block, no removals."""
    evs = [E.stored([h], None, [], 0, medium="STORAGE", group_idx=0, locality=locality) for h in hashes]
    ix.apply_payload(inst, E.batch(evs, ts=ts))


def tiers(ix: Indexer, toks: list[int]) -> dict[str, dict[str, int]]:
    return {m.instance: m.tiers for m in ix.lookup(toks).instances}


def test_a_shared_block_counts_for_every_attached_instance_only() -> None:
    ix = Indexer(BS, shared=[L2])
    for n in "abc":
        ix.register(SourceKey(n, 0))
    gpu(ix, "a", [1, 2, 3], T[:12])
    storage(ix, "a", [1, 2, 3])  # a wrote its three blocks to the shared store
    got = tiers(ix, T)
    assert got["a"] == {"GPU": 3}  # its own GPU copies come first
    assert got["b"] == {"GPU": 0, "l2": 3}  # b never computed them: the store's copy
    assert got["c"] == {"GPU": 0}  # c is not attached
    res = ix.lookup(T)
    assert res.stores == {"l2": "estimated"}
    assert ix.counters.placeholder_events == 3 and ix.counters.placeholder_blocks == 3
    assert ix.counters.offload_blocks == {"l2": 3}


def test_own_prefix_then_the_store() -> None:
    """b holds block 0 on GPU; the store holds 0..2: b matches 3, one GPU, two from the store."""
    ix = Indexer(BS, shared=[L2])
    gpu(ix, "a", [1, 2, 3], T[:12])
    storage(ix, "a", [1, 2, 3])
    gpu(ix, "b", [11], T[:4])
    assert tiers(ix, T)["b"] == {"GPU": 1, "l2": 2}


def test_capacity_bounds_a_store_without_removals() -> None:
    ix = Indexer(BS, shared=[L2])
    ix.register(SourceKey("b", 0))
    gpu(ix, "a", [1, 2, 3, 4], T)
    storage(ix, "a", [1, 2, 3, 4])  # four writes into a store of three: the oldest goes
    assert tiers(ix, T)["b"] == {"GPU": 0}  # block 0 gone: nothing matches from the start
    assert ix.stores is not None and ix.stores.drops == {"l2:capacity": 1}
    storage(ix, "a", [1])  # written again: back, and the least recent (block 1) goes
    assert tiers(ix, T[:4])["b"] == {"GPU": 0, "l2": 1}
    assert ix.stores.drops == {"l2:capacity": 2}


def test_age_bound_moves_with_any_event() -> None:
    aged = SharedStoreConfig("l2", medium="STORAGE", max_age_s=10.0)
    ix = Indexer(BS, shared=[aged])
    ix.register(SourceKey("b", 0))
    gpu(ix, "a", [1], T[:4], ts=100.0)
    storage(ix, "a", [1], ts=100.0)
    assert tiers(ix, T[:4])["b"] == {"GPU": 0, "l2": 1}
    gpu(ix, "c", [9], [7, 7, 7, 7], ts=111.0)  # another instance's event, 11 s later
    assert tiers(ix, T[:4])["b"] == {"GPU": 0}
    assert ix.stores is not None and ix.stores.drops == {"l2:age": 1}


def test_remote_blocks_no_store_takes_stay_the_instances_own() -> None:
    ix = Indexer(BS)
    gpu(ix, "a", [1, 2], T[:8])
    storage(ix, "a", [1, 2], locality="REMOTE")
    assert tiers(ix, T)["a"] == {"GPU": 2}
    gpu(ix, "a", [], [])
    assert ix.counters.remote_unshared == 2 and ix.counters.offload_blocks == {"STORAGE": 2}


def test_an_offload_child_before_its_parent_in_one_batch() -> None:
    """Self-describing offload stores come in no order: a child before its parent is applied once the
    parent is in, and the source's trust stays exact (a GPU child with an unknown parent degrades it)."""
    ix = Indexer(BS)
    child = E.stored([2], 1, T[4:8], BS, medium="CPU")
    parent = E.stored([1], None, T[:4], BS, medium="CPU")
    ix.apply_payload("a", E.batch([child, parent], ts=1.0))
    assert tiers(ix, T)["a"] == {"GPU": 0, "CPU": 2}
    assert not ix.counters.event_errors and ix.trust(SourceKey("a", 0)).value == "exact"
    orphan = E.stored([5], 4, T[4:8], BS, medium="CPU")  # its parent is known nowhere
    ix.apply_payload("a", E.batch([orphan], ts=2.0))
    assert ix.counters.event_errors == {"offload_parent_unknown": 1}
    assert ix.trust(SourceKey("a", 0)).value == "exact"


def test_a_store_that_announces_removals() -> None:
    lmc = SharedStoreConfig("lmc", medium="CPU", ownership="lmcache", announces_removals=True)
    ix = Indexer(BS, shared=[lmc])
    ix.register(SourceKey("b", 0))
    gpu(ix, "a", [1, 2], T[:8])
    ix.apply_payload("a", E.batch([E.stored([1, 2], None, [], 0, medium="CPU", ownership="lmcache")], ts=1.0))
    assert tiers(ix, T)["b"] == {"GPU": 0, "lmc": 2}
    assert ix.lookup(T).stores == {"lmc": "exact"}
    ix.apply_payload("a", E.batch([E.removed([2], medium="CPU", group_idx=0, ownership="lmcache")], ts=2.0))
    assert tiers(ix, T)["b"] == {"GPU": 0, "lmc": 1}


def test_snapshots_leave_the_stores_estimates_out() -> None:
    ix = Indexer(BS, shared=[L2])
    gpu(ix, "a", [1, 2], T[:8])
    storage(ix, "a", [1, 2])
    other = Indexer(BS, shared=[L2])
    other.register(SourceKey("b", 0))
    other.restore(ix.snapshot())
    got = tiers(other, T)
    assert got["a"] == {"GPU": 2} and got["b"] == {"GPU": 0}


def test_the_fleet_files_tiers_section() -> None:
    base = {"instances": [{"name": "a"}, {"name": "b"}]}
    cfg = parse_fleet(
        {
            **base,
            "tiers": {"cpu": {"load_gbps": 40}, "shared": [{"name": "l2", "max_age_s": 60, "load_gbps": 10}]},
        },
        FleetConfig,
    )
    assert cfg.tiers.shared[0].medium == "STORAGE" and cfg.tiers.cpu.load_gbps == 40
    bad = [
        {"shared": [{"name": "l2"}]},  # no removals and no bound
        {"shared": [{"name": "CPU", "capacity_blocks": 1}]},  # a reserved label
        {"shared": [{"name": "l2", "capacity_blocks": 1, "instances": ["z"]}]},
        {"shared": [{"name": "l2", "capacity_blocks": 1, "locality": "NEAR"}]},
        {"shared": [{"name": "l2", "capacity_blocks": 1, "medium": "GPU"}]},
        {"cpu": {"load_gbps": 0}},
    ]
    for tiers_ in bad:
        with pytest.raises(ConfigError):
            parse_fleet({**base, "tiers": tiers_}, FleetConfig)
    with pytest.raises(ConfigError, match="did you mean"):
        parse_fleet({**base, "tiers": {"shared": [{"name": "l2", "capacity_block": 1}]}}, FleetConfig)
    assert TiersConfig().shared == []
