"""The load tracker against a plain reference model, under random claim / dispatch / first token / finish /
engine observation / external load / forget sequences.

The model keeps only the requests (target, tokens to prefill, past the first token or not) and the last
observations; every per-target figure the router reads is recomputed from them from scratch.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvrouter.routing.load import LoadTracker
from kvrouter.types import RequestId, TargetKey
from tests.support.load_model import LoadModel

TARGETS = [TargetKey("w0"), TargetKey("w1"), TargetKey("w2/0"), TargetKey("w2/1")]
RIDS = [RequestId(f"r{i}") for i in range(8)]

targets = st.sampled_from(TARGETS)
rids = st.sampled_from(RIDS)


class LoadMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tracker = LoadTracker()
        self.model = LoadModel()
        self.now = 0.0

    @rule(rid=rids, tk=targets, tokens=st.integers(0, 5000))
    def dispatch(self, rid: RequestId, tk: TargetKey, tokens: int) -> None:
        self.tracker.dispatch(rid, tk, tokens)
        self.model.dispatch(rid, tk, tokens)

    @rule(rid=rids, tk=targets, cap=st.integers(1, 6))
    def claim(self, rid: RequestId, tk: TargetKey, cap: int) -> None:
        assert self.tracker.claim(rid, tk, cap) == self.model.claim(rid, tk, cap)

    @rule(rid=rids)
    def first_token(self, rid: RequestId) -> None:
        self.tracker.first_token(rid)
        r = self.model.reqs.get(rid)
        if r is not None:
            r.prefilling = False  # a second first token, or one for an unknown id, changes nothing

    @rule(rid=rids)
    def finish(self, rid: RequestId) -> None:
        self.tracker.finish(rid)
        self.model.finish(rid)

    @rule(tk=targets, running=st.integers(0, 50), waiting=st.integers(0, 50))
    def observe_engine(self, tk: TargetKey, running: int, waiting: int) -> None:
        self.now += 1.0
        self.tracker.observe_engine(tk, running, waiting, self.now)
        self.model.engine[tk] = (running, waiting)

    @rule(loads=st.dictionaries(targets, st.tuples(st.integers(0, 20), st.integers(0, 9000)), max_size=4))
    def set_external(self, loads: dict[TargetKey, tuple[int, int]]) -> None:
        self.tracker.set_external(loads)
        self.model.external = dict(loads)  # replaces the whole view: absent targets get zero

    @rule(tk=targets)
    def forget(self, tk: TargetKey) -> None:
        self.tracker.forget(tk)
        self.model.forget(tk)

    @invariant()
    def every_figure_matches(self) -> None:
        for t in TARGETS:
            load = self.tracker.get(t)
            got = {
                "in_flight": load.in_flight,
                "prefilling": load.prefilling,
                "pending_prefill_tokens": load.pending_prefill_tokens,
                "decoding": load.decoding,
                "engine_running": load.engine_running,
                "engine_waiting": load.engine_waiting,
                "external_in_flight": load.external_in_flight,
                "external_prefill_tokens": load.external_prefill_tokens,
                "effective_in_flight": load.effective_in_flight(),
                "effective_pending_prefill_tokens": load.effective_pending_prefill_tokens(),
            }
            assert got == self.model.figures(t), t
        assert self.tracker.total_in_flight() == self.model.total_in_flight()
        for rid in RIDS:
            r = self.model.reqs.get(rid)
            assert self.tracker.instance_of(rid) == (r.target if r else None)


TestLoadTrackerAgainstReference = LoadMachine.TestCase
TestLoadTrackerAgainstReference.settings = settings(
    max_examples=30, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck)
)
