"""The disaggregated planner, pure: which instance prefills, which decodes, and when a request stays whole."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from indexer import Indexer
from indexer.encode import PayloadEncoder
from kvrouter.routing import DisaggMode, DisaggPlanner, DisaggSettings, RouteInput, Router, RouterConfig
from kvrouter.routing.disagg import is_disaggregated, parse_roles, roles_label
from kvrouter.routing.router import Target
from kvrouter.types import InstanceId, RequestId, Role, TargetKey, leg_id

BS = 16
ENC = PayloadEncoder()


def fleet(spec: str = "2P2D") -> list[Target]:
    return [Target(InstanceId(f"{r[0]}{i}"), role=r) for i, r in enumerate(parse_roles(spec))]


def cache(ix: Indexer, inst: str, tokens: list[int]) -> None:
    n = len(tokens) // BS
    ix.apply_payload(inst, ENC.batch([ENC.stored(list(range(1, n + 1)), None, tokens[: n * BS], BS)], ts=1.0))


def inp(ix: Indexer, rid: str, tokens: list[int]) -> RouteInput:
    return RouteInput(RequestId(rid), len(tokens), ix.chain_hashes(tokens), bytes(str(tokens[:32]), "ascii"))


def planner(ix: Indexer, **kw: object) -> DisaggPlanner:
    """A planner whose threshold the 1k-token test prompts cross (unless ``local_prefill_tokens`` given)."""
    kw.setdefault("local_prefill_tokens", 256)
    return DisaggPlanner(Router(ix, RouterConfig(speculative=False, shadow=False)), DisaggSettings(**kw))  # type: ignore[arg-type]


PROMPT = list(range(3000, 3000 + 64 * BS))


def test_roles_spec_round_trips() -> None:
    assert parse_roles("2P2D") == ["prefill", "prefill", "decode", "decode"]
    assert roles_label(parse_roles("1P3D1B")) == "1P3D1B"
    for bad in ("", "PD", "2X", "3"):
        try:
            parse_roles(bad)
        except ValueError:
            continue
        raise AssertionError(bad)


@given(st.lists(st.sampled_from(["prefill", "decode", "both"]), min_size=1, max_size=12))
def test_roles_label_is_parse_roles_inverse(roles: list[Role]) -> None:
    assert parse_roles(roles_label(roles)) == roles


def test_only_fleets_with_roles_are_planned() -> None:
    ix = Indexer(BS)
    assert not planner(ix).applies([Target(InstanceId("a")), Target(InstanceId("b"))])
    assert planner(ix).applies(fleet())
    assert not planner(ix, mode=DisaggMode.OFF).applies(fleet())
    assert is_disaggregated(fleet("1B1D"))


def test_the_prefill_leg_goes_where_the_prompt_is_cached_and_decode_by_load() -> None:
    ix = Indexer(BS)
    cache(ix, "p1", PROMPT)
    pl = planner(ix)
    pl.router.load.dispatch(RequestId("busy"), InstanceId("d2"), 0)  # d2 decodes one request already
    plan = pl.plan(inp(ix, "a", [*PROMPT, 1, 2]), fleet())
    assert plan.split and plan.reason == "remote_prefill"
    assert plan.prefill_target is not None and plan.prefill_target.instance == "p1"
    assert plan.prefill_target.cached_tokens == 64 * BS
    assert plan.decode.chosen is not None and plan.decode.chosen.instance == "d3"
    assert plan.uncached_tokens == 64 * BS + 2


def test_a_load_only_prefill_choice_ignores_the_cache() -> None:
    ix = Indexer(BS)
    cache(ix, "p1", PROMPT)
    pl = planner(ix, prefill_policy="least-loaded")
    pl.router.load.dispatch(RequestId("x"), InstanceId("p1"), 100)
    plan = pl.plan(inp(ix, "a", [*PROMPT, 1]), fleet())
    assert plan.prefill_target is not None and plan.prefill_target.instance == "p0"


def test_a_busy_decode_instance_does_not_keep_a_short_remainder() -> None:
    ix = Indexer(BS)
    cache(ix, "d3", PROMPT)
    pl = planner(ix)
    pl.router.load.dispatch(RequestId("q"), InstanceId("d3"), 50 * len(PROMPT))  # a long local queue
    plan = pl.plan(inp(ix, "a", [*PROMPT, *range(100)]), fleet())
    assert plan.split and plan.reason == "remote_prefill"


def test_conditional_keeps_a_request_whole_where_the_decode_instance_holds_it() -> None:
    ix = Indexer(BS)
    cache(ix, "d3", PROMPT)  # blocks it received in an earlier transfer
    cache(ix, "p0", PROMPT)
    plan = planner(ix).plan(inp(ix, "a", [*PROMPT, *range(100)]), fleet())
    assert not plan.split and plan.reason == "short_uncached"
    assert plan.decode.chosen is not None and plan.decode.chosen.instance == "d3"
    assert plan.uncached_tokens == 100
    # in "always" mode the same request is split, its prefill where the prompt is cached
    plan = planner(ix, mode=DisaggMode.ALWAYS).plan(inp(ix, "b", [*PROMPT, *range(100)]), fleet())
    assert plan.split and plan.prefill_target is not None and plan.prefill_target.instance == "p0"


def test_conditional_prefills_locally_when_the_prefill_pool_is_the_bottleneck() -> None:
    ix = Indexer(BS)
    pl = planner(ix, prefill_busy_ratio=4.0)
    for p in ("p0", "p1"):
        pl.router.load.dispatch(RequestId(f"q{p}"), InstanceId(p), 20 * len(PROMPT))
    plan = pl.plan(inp(ix, "a", PROMPT), fleet())
    assert not plan.split and plan.reason == "prefill_busy"
    # ... and not with the rule off
    pl.settings = DisaggSettings(prefill_busy_ratio=0.0, local_prefill_tokens=256)
    assert pl.plan(inp(ix, "b", PROMPT), fleet()).split


def test_no_prefill_instance_up_means_whole_on_a_decode_instance() -> None:
    ix = Indexer(BS)
    targets = fleet()
    for t in targets[:2]:
        t.healthy = False
    plan = planner(ix, mode=DisaggMode.ALWAYS).plan(inp(ix, "a", PROMPT), targets)
    assert not plan.split and plan.reason == "no_prefill"
    assert plan.decode.chosen is not None and plan.decode.chosen.instance in ("d2", "d3")


def test_no_decode_instance_up_means_whole_on_a_prefill_instance() -> None:
    ix = Indexer(BS)
    cache(ix, "p1", PROMPT)
    targets = fleet()
    for t in targets[2:]:
        t.healthy = False
    plan = planner(ix).plan(inp(ix, "a", [*PROMPT, 5]), targets)
    assert not plan.split and plan.reason == "no_decode"
    assert plan.decode.chosen is not None and plan.decode.chosen.instance == "p1"


def test_limits_apply_to_both_pools() -> None:
    ix = Indexer(BS)
    router = Router(ix, RouterConfig(max_in_flight=1, speculative=False, shadow=False))
    pl = DisaggPlanner(router, DisaggSettings(local_prefill_tokens=256))
    for d in ("d2", "d3"):
        pl.router.load.dispatch(RequestId(d), InstanceId(d), 0)
    plan = pl.plan(inp(ix, "a", PROMPT), fleet())
    assert plan.decode.chosen is None and plan.reason == "at_capacity"  # the gate waits for a decode slot
    pl.router.load.finish(RequestId("d3"))
    for p in ("p0", "p1"):
        pl.router.load.dispatch(RequestId(p), InstanceId(p), 0)
    plan = pl.plan(inp(ix, "b", PROMPT), fleet())
    assert not plan.split and plan.reason == "prefill_full"


def test_an_instance_of_both_roles_is_never_both_legs() -> None:
    ix = Indexer(BS)
    cache(ix, "b0", PROMPT)
    targets = fleet("1B1D")
    pl = planner(ix, mode=DisaggMode.ALWAYS)
    pl.router.load.dispatch(RequestId("x"), InstanceId("d1"), 0)
    pl.router.load.dispatch(RequestId("y"), InstanceId("d1"), 0)
    plan = pl.plan(inp(ix, "a", [*PROMPT, 1]), targets)
    # b0 is the better decode instance (less loaded): the request stays whole there, having no other prefill
    assert plan.decode.chosen is not None and plan.decode.chosen.instance == "b0"
    assert not plan.split and plan.reason == "no_prefill"


def test_reroute_prefill_skips_failed_instances_and_the_decode_instance() -> None:
    ix = Indexer(BS)
    cache(ix, "p0", PROMPT)
    pl = planner(ix)
    targets = fleet("3P1D")
    i = inp(ix, "a", PROMPT)
    nxt = pl.reroute_prefill(i, targets, targets[3].key, {"p0"})
    assert nxt is not None and nxt.instance in ("p1", "p2")
    assert pl.reroute_prefill(i, targets, targets[3].key, {"p0", "p1", "p2"}) is None


def test_legs_are_accounted_apart() -> None:
    ix = Indexer(BS)
    pl = planner(ix)
    i = inp(ix, "a", PROMPT)
    plan = pl.plan(i, fleet())
    assert plan.split and plan.prefill_target is not None and plan.decode.chosen is not None
    r = pl.router
    r.dispatched(i, plan.prefill_target, 0.0, request_id=leg_id(i.request_id))
    r.dispatched(i, plan.decode.chosen, 0.0, prefill_tokens=0)
    p, d = r.load.get(plan.prefill_target.target), r.load.get(plan.decode.chosen.target)
    assert (p.in_flight, p.pending_prefill_tokens) == (1, len(PROMPT))
    assert (d.in_flight, d.pending_prefill_tokens) == (1, 0)
    r.finished(leg_id(i.request_id))
    r.finished(i.request_id)
    assert r.load.total_in_flight() == 0


@settings(max_examples=80, deadline=None)
@given(
    roles=st.lists(st.sampled_from(["prefill", "decode", "both"]), min_size=2, max_size=6),
    healthy=st.lists(st.booleans(), min_size=6, max_size=6),
    loads=st.lists(st.integers(0, 40), min_size=6, max_size=6),
    cached=st.lists(st.integers(0, 64), min_size=6, max_size=6),
    extra=st.integers(1, 2000),
    mode=st.sampled_from(list(DisaggMode)),
)
def test_every_plan_respects_the_roles(
    roles: list[Role], healthy: list[bool], loads: list[int], cached: list[int], extra: int, mode: DisaggMode
) -> None:
    """Whatever the state: a split request's legs are on two healthy instances that may take them; a whole
    request is on a healthy instance, a decode-capable one unless none is up; conditional splits only
    requests whose decode instance lacks more than the threshold, or would make them wait longer."""
    ix = Indexer(BS)
    targets = [Target(InstanceId(f"i{k}"), role=r, healthy=healthy[k]) for k, r in enumerate(roles)]
    pl = planner(ix, mode=mode)
    for k, t in enumerate(targets):
        cache(ix, t.instance, PROMPT[: cached[k] * BS])
        for j in range(loads[k]):
            pl.router.load.dispatch(RequestId(f"{k}-{j}"), t.key, 10)
    tokens = [*PROMPT, *range(extra)]
    if not pl.applies(targets):
        return
    plan = pl.plan(inp(ix, "r", tokens), targets)
    up = {t.key: t for t in targets if t.healthy}
    if not up:
        assert plan.decode.chosen is None
        return
    d = plan.decode.chosen
    assert d is not None and d.target in up
    any_decoder = any(t.role != "prefill" for t in up.values())
    if any_decoder:
        assert up[d.target].role != "prefill"
    if plan.split:
        p = plan.prefill_target
        assert p is not None and p.target in up and up[p.target].role != "decode" and p.target != d.target
        if mode == DisaggMode.CONDITIONAL:
            # A short remainder is split only when it would wait longer on its decode instance than on
            # the prefill instance (queued prefill there plus its own).
            local_wait = d.pending_prefill_tokens + plan.uncached_tokens
            remote_wait = p.pending_prefill_tokens + max(0, len(tokens) - p.cached_tokens)
            assert plan.uncached_tokens > pl.settings.local_prefill_tokens or local_wait > remote_wait
    else:
        assert plan.prefill is None or plan.reason in ("no_prefill", "prefill_full", "prefill_busy")


def warm(pl: DisaggPlanner, target: str, ttft: tuple[float, ...], tpot: tuple[float, ...]) -> None:
    """``target``'s models fitted to ``ttft`` and ``tpot`` coefficients, and warm."""
    m = pl.router.latency.model(TargetKey(target))
    m.models["ttft"].set(ttft)
    m.models["tpot"].set(tpot)
    for _ in range(pl.router.latency.cfg.warmup):
        m.counted("ttft")


def test_predicted_mode_takes_the_one_plan_predicted_to_meet_both_objectives() -> None:
    ix = Indexer(BS)
    pl = planner(ix, mode=DisaggMode.PREDICTED)
    cold = pl.plan(inp(ix, "a", PROMPT), fleet())
    assert cold.split and cold.reason == "remote_prefill"  # cold: the conditional rules
    # TTFT = 0.1 s + 1 s per 1k uncached tokens everywhere; TPOT = 0.01 s + 0.1 s per 1k tokens to prefill
    # there: kept whole, a decode instance's pace misses 0.05 s; split, both objectives are met
    for t in ("p0", "p1", "d2", "d3"):
        warm(pl, t, (0.1, 1.0, 0, 0, 0, 0, 0, 0), (0.01, 0, 0.1, 0))
    plan = pl.plan(inp(ix, "b", PROMPT), fleet())
    assert plan.split and plan.reason == "predicted_split"
    # prefill instances 3 s behind whatever they do: only whole meets the TTFT objective (decode
    # instances that decode unslowed by a prefill)
    for t in ("p0", "p1"):
        warm(pl, t, (3.0, 1.0, 0, 0, 0, 0, 0, 0), (0.01, 0, 0.1, 0))
    for t in ("d2", "d3"):
        warm(pl, t, (0.1, 1.0, 0, 0, 0, 0, 0, 0), (0.01, 0, 0.0, 0))
    plan = pl.plan(inp(ix, "c", PROMPT), fleet())
    assert not plan.split and plan.reason == "predicted_whole" and plan.uncached_tokens == len(PROMPT)
    # both plans meet them: the conditional rules decide (split: the decode instance lacks the prompt)
    for t in ("p0", "p1"):
        warm(pl, t, (0.1, 1.0, 0, 0, 0, 0, 0, 0), (0.01, 0, 0.1, 0))
    assert pl.plan(inp(ix, "d", PROMPT), fleet()).reason == "remote_prefill"
    # neither meets them, and whole misses the TTFT objective (decode instances 3 s behind as well): split,
    # so the prefill does not also slow the requests decoding there
    for t in ("p0", "p1", "d2", "d3"):
        warm(pl, t, (3.0, 1.0, 0, 0, 0, 0, 0, 0), (0.01, 0, 0.1, 0))
    late = pl.plan(inp(ix, "e", PROMPT), fleet())
    assert late.split and late.reason == "predicted_neither" and late.prefill_target is not None
    # neither meets them, but whole meets the TTFT objective (it misses only the pace): the conditional
    # rules decide (split: the decode instance lacks the prompt)
    for t in ("d2", "d3"):
        warm(pl, t, (0.1, 1.0, 0, 0, 0, 0, 0, 0), (0.01, 0, 0.1, 0))
    assert pl.plan(inp(ix, "f", PROMPT), fleet()).reason == "remote_prefill"


def test_a_prefill_leg_teaches_its_instance_ttft_and_a_decode_leg_only_its_pace() -> None:
    ix = Indexer(BS)
    r = planner(ix).router
    i = inp(ix, "a", PROMPT)
    plan = planner(ix).plan(i, fleet())
    assert plan.split and plan.prefill_target is not None and plan.decode.chosen is not None
    p, d = plan.prefill_target, plan.decode.chosen
    r.dispatched(i, p, 0.0, request_id=leg_id(i.request_id))
    r.dispatched(i, d, 0.0, prefill_tokens=0)
    leg = r.first_token(leg_id(i.request_id), 0.8)  # the prefill leg answered: P's TTFT
    assert leg is not None and leg.kind == "ttft" and leg.target == p.target and leg.observed_s == 0.8
    r.finished(leg_id(i.request_id))
    assert r.first_token(i.request_id, 1.0) is None  # the decode leg's first token is not D's TTFT
    pace = r.finished(i.request_id, 2.0, 11)
    assert pace is not None and pace.kind == "tpot" and pace.target == d.target
    assert abs(pace.observed_s - 0.1) < 1e-9
    assert [k for k, _ in r.latency.train()] == ["ttft", "tpot"]
