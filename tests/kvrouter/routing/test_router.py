"""Pure routing: policies, limits, speculative entries, trust fallback, consistent hashing."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from indexer import Indexer
from indexer.encode import PayloadEncoder
from kvrouter.routing import RouteInput, Router, RouterConfig, hashring
from kvrouter.routing.hashring import HashRing, stable_hash64
from kvrouter.routing.router import Target
from kvrouter.types import InstanceId, RequestId

BS = 16
ENC = PayloadEncoder()


def fleet(n: int = 3) -> list[Target]:
    return [Target(InstanceId(f"v{i}")) for i in range(n)]


def cache(ix: Indexer, inst: str, tokens: list[int]) -> None:
    n = len(tokens) // BS
    ix.apply_payload(inst, ENC.batch([ENC.stored(list(range(1, n + 1)), None, tokens[: n * BS], BS)], ts=1.0))


def inp(ix: Indexer, rid: str, tokens: list[int], salt: str | None = None) -> RouteInput:
    return RouteInput(
        RequestId(rid),
        len(tokens),
        ix.chain_hashes(tokens, cache_salt=salt),
        bytes(str(tokens[:64]), "ascii"),
    )


def test_kv_aware_goes_where_the_cache_is() -> None:
    ix = Indexer(BS)
    prompt = list(range(1000, 1000 + 64 * BS))
    cache(ix, "v2", prompt)
    r = Router(ix)
    d = r.route(inp(ix, "a", [*prompt, 1, 2, 3]), fleet())
    assert d.chosen is not None and d.chosen.instance == "v2" and d.reason == "cache"
    assert d.predicted_cached_tokens == 64 * BS
    # the last token is never served from cache: a prompt of exactly 64 blocks can hit 63 of them
    d = r.route(inp(ix, "b", prompt), fleet())
    assert d.chosen is not None and d.chosen.cached_tokens == 63 * BS


def test_kv_aware_trades_cache_against_queued_prefill() -> None:
    ix = Indexer(BS)
    prompt = list(range(5000, 5000 + 8 * BS))
    cache(ix, "v0", prompt)
    r = Router(ix, RouterConfig(speculative=False))
    # v0 holds 8 blocks, but 10k tokens of prefill are queued there: go elsewhere
    r.load.dispatch(RequestId("x"), InstanceId("v0"), 10_000)
    d = r.route(inp(ix, "a", [*prompt, 7]), fleet())
    assert d.chosen is not None and d.chosen.instance != "v0" and d.reason == "load"


def test_burst_of_a_new_prefix_sticks_together() -> None:
    ix = Indexer(BS)
    r = Router(ix)
    prefix = list(range(20_000, 20_000 + 100 * BS))
    picks = []
    for i in range(6):
        req = inp(ix, f"r{i}", [*prefix, 9000 + i] * 1)
        d = r.route(req, fleet(4), now=0.0)
        assert d.chosen is not None
        r.dispatched(req, d.chosen, now=0.0)
        picks.append(d.chosen.instance)
    assert len(set(picks)) == 1, picks  # speculative entries kept the burst on one instance


def test_a_hot_prefix_spreads_past_the_bound_and_a_burst_does_not() -> None:
    """One prefix for all traffic: its holder takes load_bound x mean + load_slack requests in flight, then
    the others get requests (each computes the prefix once); a burst within the slack stays together."""
    ix = Indexer(BS)
    prefix = list(range(30_000, 30_000 + 200 * BS))
    cache(ix, "v0", prefix)
    r = Router(ix, RouterConfig(speculative=False))
    kv = r.config.settings.kv_aware
    picks = []
    for i in range(40):
        req = inp(ix, f"h{i}", [*prefix, 7000 + i])
        d = r.route(req, fleet(4), now=0.0)
        assert d.chosen is not None
        r.dispatched(req, d.chosen, now=0.0)  # nothing finishes: in-flight counts only grow
        picks.append(d.chosen.instance)
    held = Counter(picks)
    # the holder is never chosen above the bound while another target is below it
    assert held["v0"] <= kv.load_bound * 40 / 4 + kv.load_slack + 1
    assert len(held) > 1 and held["v0"] == max(held.values())
    # a burst no larger than the slack, on an idle fleet, stays on the holder
    r2 = Router(ix, RouterConfig(speculative=False))
    burst = []
    for i in range(int(kv.load_slack)):
        req = inp(ix, f"b{i}", [*prefix, 8000 + i])
        d = r2.route(req, fleet(4), now=0.0)
        assert d.chosen is not None
        r2.dispatched(req, d.chosen, now=0.0)
        burst.append(d.chosen.instance)
    assert set(burst) == {"v0"}


def test_untrusted_instances_fall_back_to_load_alone() -> None:
    ix = Indexer(BS)
    prompt = list(range(100, 100 + 32 * BS))
    cache(ix, "v1", prompt)
    ix.sync(next(s for s in ix.sources() if s.instance == "v1")).trust = ix.trust(ix.sources()[0]).DEGRADED
    r = Router(ix, RouterConfig(speculative=False))
    d = r.route(inp(ix, "a", [*prompt, 1]), fleet())
    by = {c.instance: c for c in d.ranked}
    assert by["v1"].trust == "degraded" and by["v1"].cached_tokens == 0
    assert d.reason == "load"


def test_salts_never_match_each_other() -> None:
    ix = Indexer(BS)
    prompt = list(range(300, 300 + 16 * BS))
    r = Router(ix)
    a = inp(ix, "a", prompt, salt="tenant-a")
    d = r.route(a, fleet(), now=0.0)
    assert d.chosen is not None
    r.dispatched(a, d.chosen, now=0.0)
    b = r.candidates(inp(ix, "b", prompt, salt="tenant-b"), fleet(), now=0.0)
    assert all(c.cached_tokens == 0 for c in b)


def test_concurrency_threshold_spills_and_cap_waits() -> None:
    ix = Indexer(BS)
    prompt = list(range(700, 700 + 16 * BS))
    cache(ix, "v0", prompt)
    r = Router(ix, RouterConfig(concurrency_threshold=2, max_in_flight=3, speculative=False))
    for i in range(2):
        r.load.dispatch(RequestId(f"x{i}"), InstanceId("v0"), 0)
    d = r.route(inp(ix, "a", [*prompt, 1]), fleet(2))
    assert d.chosen is not None and d.chosen.instance == "v1" and d.reason == "spill"
    for i in range(3):
        r.load.dispatch(RequestId(f"y{i}"), InstanceId("v1"), 0)
    r.load.dispatch(RequestId("x2"), InstanceId("v0"), 0)
    d = r.route(inp(ix, "b", [*prompt, 1]), fleet(2))
    assert d.chosen is None and d.reason == "at_capacity"
    r.finished(RequestId("x0"))
    assert r.route(inp(ix, "c", [*prompt, 1]), fleet(2)).chosen is not None


def test_unhealthy_targets_are_never_chosen() -> None:
    ix = Indexer(BS)
    prompt = list(range(900, 900 + 16 * BS))
    cache(ix, "v0", prompt)
    targets = fleet(2)
    targets[0].healthy = False
    for policy in ("kv-aware", "prefix-hash", "least-loaded", "round-robin", "random"):
        r = Router(ix, RouterConfig(policy=policy))
        for i in range(5):
            d = r.route(inp(ix, f"{policy}{i}", [*prompt, i]), targets)
            assert d.chosen is not None and d.chosen.instance == "v1"
    assert Router(ix).route(inp(ix, "z", prompt), [targets[0]]).reason == "no_target"


def test_shadow_scoring_does_not_disturb_policies() -> None:
    ix = Indexer(BS)
    r1 = Router(ix, RouterConfig(policy="round-robin", shadow=True))
    r2 = Router(ix, RouterConfig(policy="round-robin", shadow=False))
    seq1, seq2 = [], []
    for i in range(7):
        q = inp(ix, str(i), list(range(i, i + 40)))
        d1, d2 = r1.route(q, fleet()), r2.route(q, fleet())
        assert d1.chosen and d2.chosen
        seq1.append(d1.chosen.instance)
        seq2.append(d2.chosen.instance)
        assert set(d1.shadow) == {
            "kv-aware",
            "prefix-hash",
            "least-loaded",
            "random",
            "session",
            "predicted-latency",
        }
        # the decision's own ranking keeps the active policy's scores (shadow ranks write theirs too)
        assert [(c.target, c.score) for c in d1.ranked] == [(c.target, c.score) for c in d2.ranked]
    assert seq1 == seq2


def test_shadow_choices_equal_each_policy_routing_alone() -> None:
    """What shadow scoring says policy P would have chosen is what a router running P chooses."""
    ix = Indexer(BS)
    shadowed = Router(ix, RouterConfig(policy="kv-aware", shadow=True))
    alone = {p: Router(ix, RouterConfig(policy=p, shadow=False)) for p in ("prefix-hash", "least-loaded")}
    for i in range(12):
        q = inp(ix, str(i), list(range(i % 3, i % 3 + 40)))
        d = shadowed.route(q, fleet(), dry_run=True)
        for name, r in alone.items():
            own = r.route(q, fleet(), dry_run=True)
            assert own.chosen is not None
            assert d.shadow[name].target == own.chosen.target, (i, name)


def test_deferred_shadow_scoring_equals_inline_scoring() -> None:
    """The gateway defers shadow scoring until its request is on the way; the answer is the one the
    decision's own snapshot gives, even after the request was dispatched and others were routed."""
    ix = Indexer(BS)
    for k in range(3):
        cache(ix, f"v{k}", list(range(k * 100, k * 100 + 64)))
    inline = Router(ix, RouterConfig(policy="kv-aware", shadow=True))
    deferred = Router(ix, RouterConfig(policy="kv-aware", shadow=True))
    for i in range(9):
        q = inp(ix, str(i), list(range((i % 3) * 100, (i % 3) * 100 + 48)))
        a = inline.route(q, fleet(), now=float(i))
        b = deferred.route(q, fleet(), now=float(i), shadow=False)
        assert a.chosen and b.chosen and b.shadow == {} and b.shadow_basis is not None
        scores = [(c.target, c.score) for c in b.ranked]
        inline.dispatched(q, a.chosen, float(i))
        deferred.dispatched(q, b.chosen, float(i))
        # another request routed in between (deferred too: random's dry-run draws are policy state)
        deferred.route(inp(ix, f"other{i}", [7] * 40), fleet(), now=float(i), shadow=False)
        assert deferred.shadow(b) == a.shadow and b.shadow_basis is None
        assert deferred.shadow(b) is b.shadow  # once
        assert [(c.target, c.score) for c in b.ranked] == scores  # the active policy's scores restored


def test_baselines_spread_load() -> None:
    ix = Indexer(BS)
    for policy in ("round-robin", "random", "least-loaded"):
        r = Router(ix, RouterConfig(policy=policy, settings=r_settings(7)))
        counts: Counter[str] = Counter()
        for i in range(300):
            q = inp(ix, f"{policy}{i}", [i] * 40)
            d = r.route(q, fleet(3))
            assert d.chosen is not None
            counts[d.chosen.instance] += 1
            if policy == "least-loaded":
                r.dispatched(q, d.chosen, 0.0)
        assert min(counts.values()) >= 70, (policy, counts)


def r_settings(seed: int):  # type: ignore[no-untyped-def]
    from kvrouter.routing.policies import PolicySettings

    return PolicySettings(seed=seed)


def test_prefix_hash_keeps_affinity_until_bounded_load() -> None:
    ix = Indexer(BS)
    r = Router(ix, RouterConfig(policy="prefix-hash"))
    same = RouteInput(RequestId("a"), 100, None, b"system prompt A")
    first = r.route(same, fleet(4)).chosen
    assert first is not None
    for i in range(3):  # affinity holds while the owner is within the bound
        d = r.route(RouteInput(RequestId(f"s{i}"), 100, None, b"system prompt A"), fleet(4))
        assert d.chosen is not None and d.chosen.target == first.target and d.reason == "affinity"
    for i in range(4):
        r.load.dispatch(RequestId(f"busy{i}"), InstanceId(first.target), 0)
    d = r.route(RouteInput(RequestId("b"), 100, None, b"system prompt A"), fleet(4))
    assert d.chosen is not None and d.chosen.target != first.target


@settings(max_examples=50, deadline=None)
@given(n=st.integers(2, 12), seed=st.integers(0, 10_000))
def test_hash_ring_moves_only_the_keys_of_a_leaving_or_joining_instance(n: int, seed: int) -> None:
    rng = random.Random(seed)
    names = [InstanceId(f"i{k}") for k in range(n)]
    ring = HashRing(names, vnodes=50)
    keys = [rng.randbytes(12) for _ in range(300)]
    before = {k: ring.walk(k)[0] for k in keys}
    gone = rng.choice(names)
    ring.remove(gone)
    after = {k: ring.walk(k)[0] for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != gone)
    ring.add(InstanceId("new"))
    again = {k: ring.walk(k)[0] for k in keys}
    assert all(again[k] in (after[k], "new") for k in keys)


def _reference_walk(ring: HashRing, key: bytes) -> list[str]:
    """The ring walked point by point, without the per-point cache: the definition of ``walk``."""
    points = sorted((p, o) for p, o in zip(ring._points, ring._owners))
    if not points:
        return []
    h = stable_hash64(key)
    start = next((i for i, (p, _) in enumerate(points) if p > h), len(points))
    out: list[str] = []
    for k in range(len(points)):
        o = points[(start + k) % len(points)][1]
        if o not in out:
            out.append(o)
    return out


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 7)), max_size=25),
    keys=st.lists(st.binary(max_size=20), min_size=1, max_size=30),
)
def test_hash_ring_cached_walks_equal_the_point_by_point_walk(
    ops: list[tuple[bool, int]], keys: list[bytes]
) -> None:
    """Walks are cached per landing point; joins and leaves in any order never leave a stale one, and
    a cache that outgrows its bound starts over without changing an answer."""
    saved = hashring._MAX_CACHED_IDS
    try:
        for cap in (saved, 5):
            hashring._MAX_CACHED_IDS = cap
            ring = HashRing(vnodes=7)
            for join, i in ops:
                if join:
                    ring.add(InstanceId(f"i{i}"))
                else:
                    ring.remove(InstanceId(f"i{i}"))
                for k in keys:
                    assert list(ring.walk(k)) == _reference_walk(ring, k)
                    assert ring._cached_ids == sum(len(o) for o in ring._orders.values()) <= max(cap, 8)
    finally:
        hashring._MAX_CACHED_IDS = saved


def test_replicas_agree_on_a_cold_prefix_and_cold_prefixes_spread() -> None:
    """Exact ties on an idle fleet are broken by consistent hashing of the prefix: two routers that share
    nothing pick the same target for the same new prefix, and different prefixes land all over."""
    a, b = Router(Indexer(BS)), Router(Indexer(BS))
    picks = Counter()
    for i in range(60):
        key = f"system prompt number {i}".encode()
        da = a.route(RouteInput(RequestId(f"a{i}"), 500, None, key), fleet(4))
        db = b.route(RouteInput(RequestId(f"b{i}"), 500, None, key), fleet(4))
        assert da.chosen and db.chosen and da.chosen.target == db.chosen.target
        picks[da.chosen.target] += 1
    assert len(picks) == 4 and min(picks.values()) >= 6, picks


def test_instances_without_events_are_routed_by_load_and_speculative_entries() -> None:
    """No `events` endpoint: the index never hears from it, so it earns cache credit only from the router's
    own speculative entries (a burst still sticks); nothing raises."""
    ix = Indexer(BS)
    r = Router(ix)
    targets = [Target(InstanceId(f"w{i}"), has_events=False) for i in range(3)]
    prefix = list(range(40_000, 40_000 + 40 * BS))
    picks = []
    for i in range(4):
        q = inp(ix, f"n{i}", [*prefix, i])
        d = r.route(q, targets, now=0.0)
        assert d.chosen is not None and d.chosen.trust == "none"
        r.dispatched(q, d.chosen, now=0.0)
        picks.append(d.chosen.target)
    assert len(set(picks)) == 1


def test_rollouts_do_not_grow_the_rings_and_keep_prefix_affinity() -> None:
    """A Kubernetes rollout renames every pod.  After 50 rollouts the policies' rings hold a bounded
    number of members, and prefix-hash sends each key where a fresh ring of the current pods would."""
    ix = Indexer(BS)
    r = Router(ix, RouterConfig(policy="prefix-hash", shadow=True))
    keys = [f"system prompt {k}".encode() for k in range(40)]
    for rollout in range(50):
        pods = [Target(InstanceId(f"pod-{rollout}-{i}")) for i in range(4)]
        fresh = HashRing([p.instance for p in pods], vnodes=r.policy("prefix-hash").ring.vnodes)  # type: ignore[attr-defined]
        for k, key in enumerate(keys):
            d = r.route(RouteInput(RequestId(f"{rollout}-{k}"), 100, None, key), pods, dry_run=True)
            assert d.chosen is not None and d.chosen.target == fresh.walk(key)[0]
    for name in ("prefix-hash", "kv-aware"):
        assert len(r.policy(name).ring.members) <= 2 * 4 + 4, name  # type: ignore[attr-defined]


def test_session_stays_on_its_instance_while_healthy_and_within_limits() -> None:
    ix = Indexer(BS)
    r = Router(ix, RouterConfig(policy="session", concurrency_threshold=4, speculative=False))

    def send(rid: str, tokens: list[int], targets: list[Target], session: str | None = "s1") -> str:
        q = inp(ix, rid, tokens)
        q.session = session
        d = r.route(q, targets, now=float(len(rid)))
        assert d.chosen is not None
        r.dispatched(q, d.chosen, now=float(len(rid)))
        return f"{d.chosen.instance}:{d.reason}"

    # the other instances hold this prompt's prefix: kv-aware would move the session there
    prompt = list(range(3000, 3000 + 16 * BS))
    first = send("a", list(range(9000, 9040)), fleet())
    home = first.split(":")[0]
    for other in ("v0", "v1", "v2"):
        if other != home:
            cache(ix, other, prompt)
    assert send("bb", prompt, fleet()) == f"{home}:session"
    # a request without a session is routed kv-aware (to the cache)
    assert send("ccc", prompt, fleet(), session=None).split(":")[0] != home
    # its instance out of rotation: kv-aware, and the session moves with it
    down = [Target(InstanceId(t.instance), healthy=t.instance != home) for t in fleet()]
    moved = send("dddd", prompt, down)
    assert moved.split(":")[0] != home and moved.endswith(":cache")
    assert send("eeeee", prompt, fleet()) == f"{moved.split(':')[0]}:session"
    # its instance at the concurrency threshold: kv-aware again
    new_home = moved.split(":")[0]
    for i in range(4):
        r.load.dispatch(RequestId(f"busy{i}"), InstanceId(new_home), 10)
    assert send("ffffff", prompt, fleet()).split(":")[0] != new_home


def test_session_is_shadow_scored_from_real_dispatches() -> None:
    """With kv-aware active, the session policy's shadow choice is where the session's last request went."""
    ix = Indexer(BS)
    r = Router(ix, RouterConfig(policy="kv-aware", speculative=False))
    q = inp(ix, "a", list(range(100, 140)))
    q.session = "s"
    d = r.route(q, fleet(), now=1.0)
    assert d.chosen is not None
    r.dispatched(q, d.chosen, now=1.0)
    last = d.chosen.target
    prompt = list(range(7000, 7000 + 8 * BS))
    for t in fleet():
        if t.instance != last:
            cache(ix, t.instance, prompt)
    q2 = inp(ix, "b", prompt)
    q2.session = "s"
    d2 = r.route(q2, fleet(), now=2.0)
    assert d2.chosen is not None and d2.chosen.target != last
    assert d2.shadow["session"].target == last
    # forgotten after its time to live: the session policy agrees with kv-aware again
    q3 = inp(ix, "c", prompt)
    q3.session = "s"
    d3 = r.route(q3, fleet(), now=2.0 + r.config.settings.session.ttl_s + 1)
    assert d3.shadow["session"].target == d3.chosen.target  # type: ignore[union-attr]
