"""The kv-aware and bounded-load scoring against a reference written here, on random candidate sets; and the
router's limits (concurrency threshold, hard cap) on random fleets with loads and cached prefixes.

Reference for kv-aware (``policies.py``'s docstring, restated): cost = queued prefill + (1 + compute_weight)
x prompt tokens still to compute + load_weight x in flight, divided by the target's weight; a target whose
in-flight per weight exceeds load_bound x the fleet's mean + load_slack goes last unless every target does;
then lower cost, then fewer in flight, then more cached.  Exact ties may come in any order (a hash ring
breaks them), so the ranking must be sorted by that key, not equal to one particular order.  The placement
band (``placement_band``) may reorder the leading run of that order whose targets are within bound, hold
as much of the prompt as the first and cost at most (1 + placement_band) x its cost: that run comes first
in any order, the rest in the reference order (tests/kvrouter/routing/test_placement_band.py checks how the
band orders its run).
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer import Indexer, SourceKey
from kvrouter.routing import RouteInput, Router, RouterConfig
from kvrouter.routing.policies import Candidate, KvAware, KvAwareSettings, RouteView
from kvrouter.routing.router import Target
from kvrouter.types import InstanceId, RequestId, TargetKey

S = KvAwareSettings()


def ref_cost(num_tokens: int, c: Candidate) -> float:
    to_compute = max(0, num_tokens - c.cached_tokens)
    raw = c.pending_prefill_tokens + (1 + S.compute_weight) * to_compute + S.load_weight * c.in_flight
    return raw / c.weight


def ref_over(cands: list[Candidate]) -> set[str]:
    if len(cands) < 2:
        return set()
    per = {c.target: c.in_flight / c.weight for c in cands}
    cap = S.load_bound * sum(per.values()) / len(per) + S.load_slack
    over = {t for t, x in per.items() if x > cap}
    return set() if len(over) == len(cands) else over


def ref_key(num_tokens: int, over: set[str], c: Candidate) -> tuple[bool, float, int, int]:
    return (c.target in over, ref_cost(num_tokens, c), c.in_flight, -c.cached_tokens)


def ref_band(num_tokens: int, over: set[str], in_order: list[Candidate]) -> int:
    """How many of the reference-ordered candidates form the placement band."""
    if len(in_order) < 2:
        return len(in_order)
    lead = in_order[0]
    limit = ref_cost(num_tokens, lead) * (1 + S.placement_band)
    n = 0
    for c in in_order:
        if c.target in over or c.cached_tokens != lead.cached_tokens or ref_cost(num_tokens, c) > limit:
            break
        n += 1
    return n


candidate = st.builds(
    lambda i, inflight, cached, pending, weight: Candidate(
        InstanceId(f"w{i}"),
        0,
        TargetKey(f"w{i}"),
        cached_tokens=cached,
        in_flight=inflight,
        pending_prefill_tokens=pending,
        weight=weight,
    ),
    st.integers(0, 0),  # renamed below: ids must be distinct
    st.sampled_from([0, 1, 2, 5, 20, 60]),  # few values: equal loads (and exact ties) are common
    st.sampled_from([0, 16, 256, 1024, 4096]),
    st.sampled_from([0, 512, 8192]),
    st.sampled_from([1.0, 2.0]),
)


def fleet_of(cands: list[Candidate]) -> list[Candidate]:
    for i, c in enumerate(cands):
        c.instance, c.target = InstanceId(f"w{i}"), TargetKey(f"w{i}")
    return cands


@settings(max_examples=150, deadline=None)
@given(
    cands=st.lists(candidate, min_size=1, max_size=6).map(fleet_of),
    num_tokens=st.sampled_from([1, 100, 1024, 4097]),
    key=st.binary(max_size=8),
)
def test_kv_aware_ranks_by_the_reference_key(cands: list[Candidate], num_tokens: int, key: bytes) -> None:
    ranked = KvAware().rank(RouteView(num_tokens, key), list(cands))
    assert sorted(c.target for c in ranked) == sorted(c.target for c in cands)  # a permutation
    over = ref_over(cands)
    keys = [ref_key(num_tokens, over, c) for c in ranked]
    want = sorted(keys)
    n = ref_band(num_tokens, over, sorted(cands, key=lambda c: ref_key(num_tokens, over, c)))
    assert sorted(keys[:n]) == want[:n], "the placement band is not the reference's leading run"
    assert keys[n:] == want[n:], "not in reference order after the placement band"
    for c in ranked:
        assert c.score == ref_cost(num_tokens, c)
    # the named guarantees, said directly
    best = ranked[0]
    assert best.target not in over, "an over-bound target chosen while another was within bound"
    for a in ranked:
        for b in ranked:
            same_load = (a.in_flight, a.pending_prefill_tokens, a.weight) == (
                b.in_flight,
                b.pending_prefill_tokens,
                b.weight,
            )
            if same_load and a.cached_tokens > b.cached_tokens:
                assert ranked.index(a) < ranked.index(b), "more cached lost to less cached at equal load"


BS = 16
PROMPT = list(range(1, 16 * BS + 2))  # 16 full blocks and a last token


@settings(max_examples=80, deadline=None)
@given(
    loads=st.lists(st.integers(0, 12), min_size=2, max_size=5),
    cached_blocks=st.lists(st.integers(0, 16), min_size=5, max_size=5),
    threshold=st.sampled_from([0, 2, 5, 8]),
    cap=st.sampled_from([0, 3, 6, 13]),
    policy=st.sampled_from(["kv-aware", "prefix-hash", "least-loaded", "round-robin", "random"]),
)
def test_router_limits_hold_for_every_policy(
    loads: list[int], cached_blocks: list[int], threshold: int, cap: int, policy: str
) -> None:
    """A saturated target (in flight >= concurrency_threshold) is chosen only when every open target is; a
    target at the hard cap never is, and when all are the request waits (no choice, ``at_capacity``); under
    kv-aware, an over-bound target only when every target is."""
    ix = Indexer(BS)
    targets = [Target(InstanceId(f"w{i}")) for i in range(len(loads))]
    router = Router(ix, RouterConfig(policy=policy, concurrency_threshold=threshold, max_in_flight=cap))
    chains = ix.chain_hashes(PROMPT)
    for i, (t, n) in enumerate(zip(targets, loads)):
        ix.register(SourceKey(t.instance, 0))
        if cached_blocks[i]:
            ix.add_speculative(SourceKey(t.instance, 0), chains[: cached_blocks[i]], now=0.0)
        for k in range(n):
            router.load.dispatch(RequestId(f"{t.instance}-{k}"), t.key, 100)
    inp = RouteInput(RequestId("q"), len(PROMPT), chains, b"prefix")
    d = router.route(inp, targets, now=0.0)
    open_ = [c for c in d.ranked if not cap or c.in_flight < cap]
    if cap and all(n >= cap for n in loads):
        assert d.chosen is None and d.reason == "at_capacity"
        return
    assert d.chosen is not None
    chosen = d.chosen
    assert not cap or chosen.in_flight < cap
    assert chosen.in_flight == loads[int(chosen.instance[1:])]
    if threshold:
        saturated = [c.in_flight >= threshold for c in open_]
        assert chosen.saturated == (chosen.in_flight >= threshold)
        assert not chosen.saturated or all(saturated), "a saturated target chosen while another was not"
        assert d.reason == "spill" or chosen is d.ranked[0]
    if policy == "kv-aware" and not (threshold and chosen.saturated):
        assert chosen.target not in ref_over(open_)
    # the cache the router credits is the prefix each target holds, capped by vLLM's last-token rule
    for c in d.ranked:
        want = min(cached_blocks[int(c.instance[1:])], (len(PROMPT) - 1) // BS) * BS
        assert c.cached_tokens == want


def test_reference_sees_the_bound() -> None:
    """The reference itself: one target far above the mean is over, none when all are."""
    cs = fleet_of([Candidate(InstanceId("x"), 0, TargetKey("x"), in_flight=n) for n in (0, 0, 40)])
    assert ref_over(cs) == {"w2"}
    assert ref_over(fleet_of([Candidate(InstanceId("x"), 0, TargetKey("x"), in_flight=40)] * 1)) == set()
    assert np.isclose(ref_cost(10, cs[0]), (1 + S.compute_weight) * 10)
