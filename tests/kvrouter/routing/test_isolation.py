"""Quiet targets: heavy flows never use them, the others use them first; every router picks the same."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from indexer import Indexer
from indexer.errors import ConfigError
from kvrouter.routing import RouteInput, Router, RouterConfig
from kvrouter.routing.isolation import Isolation, QuietTargets
from kvrouter.routing.policies import Candidate
from kvrouter.routing.router import Target
from kvrouter.routing.saturation import Saturation
from kvrouter.types import InstanceId, RequestId, TargetKey


def cands(names: list[str]) -> list[Candidate]:
    return [Candidate(InstanceId(n), 0, TargetKey(n)) for n in names]


@given(
    st.lists(st.text("abcdefgh", min_size=1, max_size=4), min_size=1, max_size=12, unique=True),
    st.sampled_from([0.1, 0.25, 0.5, 0.9]),
    st.randoms(use_true_random=False),
)
def test_the_quiet_set_is_sized_stable_and_lanes_split_the_open_targets(
    names: list[str], share: float, rnd: object
) -> None:
    iso = Isolation(quiet_share=share)
    keys = frozenset(TargetKey(n) for n in names)
    quiet = QuietTargets(iso).of(keys)
    n = len(names)
    want = 0 if n < 2 else min(n - 1, max(1, math.ceil(share * n - 1e-9)))
    assert len(quiet) == want and quiet <= keys
    # another router (another process, another order of the same fleet) picks the same targets
    shuffled = list(names)
    rnd.shuffle(shuffled)  # type: ignore[attr-defined]
    assert QuietTargets(iso).of(frozenset(TargetKey(x) for x in shuffled)) == quiet
    cs = cands(shuffled)
    open_ = cs[: max(1, n // 2)]
    heavy = QuietTargets(iso).lane(open_, cs, heavy=True)
    light = QuietTargets(iso).lane(open_, cs, heavy=False)
    assert all(c.target not in quiet for c in heavy) and all(c in open_ for c in heavy)
    open_quiet = [c for c in open_ if c.target in quiet]
    assert light == (open_quiet or open_)
    # off: every open target, heavy or not
    assert QuietTargets(Isolation()).lane(open_, cs, heavy=True) == open_


def test_heavy_requests_stay_off_the_quiet_target_and_wait_when_their_lane_is_full() -> None:
    iso = Isolation(quiet_share=0.5)
    sat = Saturation(max_prefill_tokens=1000)
    r = Router(Indexer(16), RouterConfig(saturation=sat, isolation=iso, speculative=False, shadow=False))
    targets = [Target(InstanceId("v0")), Target(InstanceId("v1"))]
    (quiet,) = r.quiet.of(frozenset(t.key for t in targets))
    other = next(t.key for t in targets if t.key != quiet)
    # the quiet target is the more loaded one: kv-aware alone would send everything to the other
    r.load.dispatch(RequestId("q"), quiet, 500)
    light = r.route(RouteInput(RequestId("light"), 100), targets)
    assert light.chosen is not None and light.chosen.target == quiet
    heavy = r.route(RouteInput(RequestId("heavy"), 100, heavy=True), targets)
    assert heavy.chosen is not None and heavy.chosen.target == other
    r.load.dispatch(RequestId("h"), other, 1500)  # the heavy lane is full
    assert r.route(RouteInput(RequestId("heavy2"), 100, heavy=True), targets).reason == "at_capacity"
    spill = r.route(RouteInput(RequestId("light2"), 100), targets)
    assert spill.chosen is not None and spill.chosen.target == quiet
    # no flow needs the quiet target (Isolation.idle_s): a heavy request takes it when it is the open one
    idle = r.route(RouteInput(RequestId("heavy3"), 100, heavy=True, quiet_open=True), targets)
    assert idle.chosen is not None and idle.chosen.target == quiet
    r.load.dispatch(RequestId("q2"), quiet, 1000)  # the quiet one full too: a light request goes anywhere
    r.first_token(RequestId("h"))
    anywhere = r.route(RouteInput(RequestId("light3"), 100), targets)
    assert anywhere.chosen is not None and anywhere.chosen.target == other


def test_bad_isolation_settings_are_refused() -> None:
    for bad in (Isolation(quiet_share=1.0), Isolation(quiet_share=-0.1), Isolation(over_share=0.9)):
        with pytest.raises(ConfigError):
            bad.validate()
    for bad in (Isolation(half_life_s=0), Isolation(backlog=-1), Isolation(idle_s=-1)):
        with pytest.raises(ConfigError):
            bad.validate()
