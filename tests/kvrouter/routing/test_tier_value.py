"""A cached block's worth by tier: the arithmetic from the fleet file, the split the router credits (against
a block-by-block reference), and decisions where the tier, not the block count, decides."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer import Indexer, SourceKey
from indexer.encode import PayloadEncoder
from indexer.tiers import LocalTierConfig, SharedStoreConfig, TiersConfig
from kvrouter.routing import RouteInput, Router, RouterConfig
from kvrouter.routing.policies import KvAwareSettings, PolicySettings
from kvrouter.routing.router import Target
from kvrouter.routing.tier_value import DEFAULT_SHARED_GBPS, credited_split, tier_values
from kvrouter.types import InstanceId, RequestId

BS = 4
E = PayloadEncoder("0.33.0")
PROMPT = [*range(100, 100 + 8 * BS), 7]  # eight full blocks and one more token


def test_worth_is_what_loading_saves_over_recomputing() -> None:
    cfg = TiersConfig(
        kv_bytes_per_token=131_072,
        prefill_tokens_per_s=10_000,
        cpu=LocalTierConfig(load_gbps=40),
        storage=LocalTierConfig(load_gbps=1),
        shared=[SharedStoreConfig("l2", capacity_blocks=10, load_gbps=4)],
    )
    v = tier_values(cfg)
    # a thousand tokens: 131 MB; recomputing them takes 100 ms
    assert v.recompute_ms_per_1k_tokens == pytest.approx(100.0)
    assert v.load_ms_per_1k_tokens["CPU"] == pytest.approx(131.072 / 40)
    assert v.of("CPU") == pytest.approx(1 - 3.2768 / 100)
    assert v.of("l2") == pytest.approx(1 - 32.768 / 100)
    assert v.of("STORAGE") == 0.0  # 131 ms to load what 100 ms recompute: no preference for it
    assert v.of("GPU") == v.of("speculative") == 1.0
    # a store the fleet file does not declare: the default network link's bandwidth, on this fleet's model
    assert v.of("undeclared-store") == pytest.approx(1 - 131.072 / DEFAULT_SHARED_GBPS / 100)


@settings(max_examples=60, deadline=None)
@given(st.floats(0.1, 1000), st.floats(0.1, 1000))
def test_a_faster_tier_is_never_worth_less(slow: float, fast: float) -> None:
    slow, fast = min(slow, fast), max(slow, fast)
    a = tier_values(TiersConfig(cpu=LocalTierConfig(load_gbps=slow))).of("CPU")
    b = tier_values(TiersConfig(cpu=LocalTierConfig(load_gbps=fast))).of("CPU")
    assert 0.0 <= a <= b < 1.0


TIERS = ("GPU", "CPU", "STORAGE", "l2", "l3")


@settings(max_examples=150, deadline=None)
@given(
    st.dictionaries(st.sampled_from(TIERS), st.integers(0, 6)),
    st.integers(0, 6),
    st.integers(-1, 30),
    st.sets(st.sampled_from(("l2", "l3"))),
)
def test_split_matches_a_block_by_block_reference(
    tiers: dict[str, int], spec: int, max_hit: int, unusable: set[str]
) -> None:
    # Reference: lay the blocks out fastest tier first, drop untrusted stores', keep the first max_hit.
    order = ["GPU", "speculative", "CPU", "STORAGE", *[t for t in tiers if t in ("l2", "l3")]]
    counts = {**tiers, "speculative": spec}
    blocks = [t for t in order if t not in unusable for _ in range(counts.get(t, 0))]
    want: dict[str, int] = {}
    for t in blocks[: max(0, max_hit)]:
        want[t] = want.get(t, 0) + 1
    assert credited_split(tiers, spec, max_hit, unusable) == want


# ---------------------------------------------------------------- decisions on a real index


def _gpu(ix: Indexer, inst: str, n: int) -> None:
    ix.apply_payload(inst, E.batch([E.stored(list(range(1, n + 1)), None, PROMPT[: n * BS], BS)], ts=1.0))


def _offload(ix: Indexer, inst: str, n: int, medium: str) -> None:
    """The OffloadingConnector's placeholders: the GPU blocks' hashes announced on ``medium``."""
    evs = [E.stored([h], None, [], 0, medium=medium, group_idx=0) for h in range(1, n + 1)]
    ix.apply_payload(inst, E.batch(evs, ts=2.0))


def _evict_gpu(ix: Indexer, inst: str, n: int) -> None:
    ix.apply_payload(inst, E.batch([E.removed(list(range(1, n + 1)))], ts=3.0))


def _fleet(ix: Indexer) -> list[Target]:
    for n in ("a", "b", "c"):
        ix.register(SourceKey(n, 0))
    return [Target(InstanceId(n)) for n in ("a", "b", "c")]


def _route(r: Router, ix: Indexer, targets: list[Target]) -> tuple[str, dict[str, dict[str, int]]]:
    inp = RouteInput(RequestId("q"), len(PROMPT), ix.chain_hashes(PROMPT), b"k")
    d = r.route(inp, targets, now=5.0, dry_run=True)
    assert d.chosen is not None
    return d.chosen.instance, {c.instance: c.tiers for c in d.ranked}


def _tiers(cpu: float, l2: float) -> TiersConfig:
    return TiersConfig(
        cpu=LocalTierConfig(load_gbps=cpu),
        shared=[SharedStoreConfig("l2", instances=["a", "b"], capacity_blocks=100, load_gbps=l2)],
    )


@pytest.mark.parametrize(("cpu", "l2", "winner"), [(50.0, 10.0, "a"), (5.0, 100.0, "b")])
def test_the_faster_tier_wins_at_equal_blocks(cpu: float, l2: float, winner: str) -> None:
    """a holds the prefix in its own CPU tier; b holds none of it but attaches the shared store, which
    holds it too (a wrote it there).  Eight blocks each: the tier's bandwidth decides."""
    cfg = _tiers(cpu, l2)
    ix = Indexer(BS, shared=cfg.shared)
    targets = _fleet(ix)
    _gpu(ix, "a", 8)
    _offload(ix, "a", 8, "CPU")
    _offload(ix, "a", 8, "STORAGE")  # STORAGE events from a feed the shared store
    _evict_gpu(ix, "a", 8)
    r = Router(ix, RouterConfig(speculative=False, shadow=False, tiers=tier_values(cfg)))
    chosen, split = _route(r, ix, targets)
    assert split["a"] == {"CPU": 8} and split["b"] == {"l2": 8} and split["c"] == {}
    assert chosen == winner


def test_shared_store_credit_beats_recomputing_but_not_the_gpu() -> None:
    cfg = _tiers(50.0, 12.5)
    ix = Indexer(BS, shared=cfg.shared)
    targets = _fleet(ix)
    _gpu(ix, "a", 8)
    _offload(ix, "a", 8, "STORAGE")
    r = Router(ix, RouterConfig(speculative=False, shadow=False, tiers=tier_values(cfg)))
    chosen, split = _route(r, ix, targets)
    assert chosen == "a" and split["a"] == {"GPU": 8} and split["b"] == {"l2": 8}
    inp = RouteInput(RequestId("q"), len(PROMPT), ix.chain_hashes(PROMPT), b"k")
    by = {c.instance: c for c in r.route(inp, targets, now=5.0, dry_run=True).ranked}
    v = r.tier_values.of("l2")
    assert 0 < v < 1
    assert by["b"].hit_tokens == 8 * BS and by["b"].cached_tokens == round(8 * BS * v)
    assert by["a"].cached_tokens == by["a"].hit_tokens == 8 * BS
    assert by["c"].cached_tokens == 0
    # c is not attached: the store's blocks never reach it; b beats c on the store's credit alone
    assert r.route(inp, targets[1:], now=5.0, dry_run=True).ranked[0].instance == "b"


def test_a_flat_offload_value_overrides_every_tier() -> None:
    cfg = _tiers(5.0, 100.0)  # l2 faster than a's CPU tier ...
    ix = Indexer(BS, shared=cfg.shared)
    targets = _fleet(ix)
    _gpu(ix, "a", 8)
    _offload(ix, "a", 8, "CPU")
    _offload(ix, "a", 8, "STORAGE")
    _evict_gpu(ix, "a", 8)
    flat = PolicySettings(kv_aware=KvAwareSettings(offload_value=0.5))
    r = Router(ix, RouterConfig(speculative=False, shadow=False, tiers=tier_values(cfg), settings=flat))
    inp = RouteInput(RequestId("q"), len(PROMPT), ix.chain_hashes(PROMPT), b"k")
    by = {c.instance: c for c in r.route(inp, targets, now=5.0, dry_run=True).ranked}
    assert by["a"].cached_tokens == by["b"].cached_tokens == 4 * BS  # ... but both at 0.5 here
