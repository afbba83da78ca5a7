"""Trackers of several workers sharing one host's memory against the in-process tracker and the reference
model: whatever the workers do, each of them, after ``refresh``, sees every figure one process would.

Each worker dispatches, advances and finishes its own requests (ids are per worker, as in the gateway); any
worker may observe an engine or replace the external load; an instance leaving is forgotten by every worker.
The reference ``LoadTracker`` receives every operation of every worker; the model recomputes the figures.
"""

from __future__ import annotations

import threading

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvrouter.host import HostLayout, HostLoads, HostMemory
from kvrouter.routing.load import InstanceLoad, LoadTracker
from kvrouter.types import RequestId, TargetKey
from tests.support.load_model import LoadModel

WORKERS = 3
TARGETS = [TargetKey("w0"), TargetKey("w1"), TargetKey("w2/0"), TargetKey("w2/1")]
targets = st.sampled_from(TARGETS)
workers = st.integers(0, WORKERS - 1)
rids = st.sampled_from([RequestId(f"r{i}") for i in range(6)])

FIELDS = (
    "in_flight",
    "prefilling",
    "pending_prefill_tokens",
    "decoding",
    "engine_running",
    "engine_waiting",
    "external_in_flight",
    "external_prefill_tokens",
)


def figures(load: InstanceLoad) -> dict[str, int]:
    out = {f: getattr(load, f) for f in FIELDS}
    out["effective_in_flight"] = load.effective_in_flight()
    out["effective_pending_prefill_tokens"] = load.effective_pending_prefill_tokens()
    return out


class SharedLoadMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        layout = HostLayout(workers=WORKERS, targets=8, instances=4, ring_words=64)
        mem = HostMemory(layout, bytearray(layout.size()), threading.Lock())
        self.workers = [LoadTracker(HostLoads(mem, k)) for k in range(WORKERS)]
        self.reference = LoadTracker()
        self.model = LoadModel()
        self.now = 0.0

    @staticmethod
    def _rid(k: int, rid: RequestId) -> RequestId:
        return RequestId(f"w{k}:{rid}")

    @rule(k=workers, rid=rids, tk=targets, tokens=st.integers(0, 5000))
    def dispatch(self, k: int, rid: RequestId, tk: TargetKey, tokens: int) -> None:
        self.workers[k].dispatch(rid, tk, tokens)
        self.reference.dispatch(self._rid(k, rid), tk, tokens)
        self.model.dispatch(self._rid(k, rid), tk, tokens)

    @rule(k=workers, rid=rids, tk=targets, cap=st.integers(1, 6))
    def claim(self, k: int, rid: RequestId, tk: TargetKey, cap: int) -> None:
        """Each worker checks the host's count (every row and the external load) under the lock."""
        want = self.model.claim(self._rid(k, rid), tk, cap)
        assert self.workers[k].claim(rid, tk, cap) == want
        assert self.reference.claim(self._rid(k, rid), tk, cap) == want

    @rule(k=workers, rid=rids)
    def first_token(self, k: int, rid: RequestId) -> None:
        self.workers[k].first_token(rid)
        self.reference.first_token(self._rid(k, rid))
        r = self.model.reqs.get(self._rid(k, rid))
        if r is not None:
            r.prefilling = False

    @rule(k=workers, rid=rids)
    def finish(self, k: int, rid: RequestId) -> None:
        self.workers[k].finish(rid)
        self.reference.finish(self._rid(k, rid))
        self.model.finish(self._rid(k, rid))

    @rule(k=workers, tk=targets, running=st.integers(0, 50), waiting=st.integers(0, 50))
    def observe_engine(self, k: int, tk: TargetKey, running: int, waiting: int) -> None:
        self.now += 1.0
        self.workers[k].observe_engine(tk, running, waiting, self.now)
        self.reference.observe_engine(tk, running, waiting, self.now)
        self.model.engine[tk] = (running, waiting)

    @rule(
        k=workers,
        loads=st.dictionaries(targets, st.tuples(st.integers(0, 20), st.integers(0, 9000)), max_size=4),
    )
    def set_external(self, k: int, loads: dict[TargetKey, tuple[int, int]]) -> None:
        self.workers[k].set_external(loads)
        self.reference.set_external(loads)
        self.model.external = dict(loads)

    @rule(tk=targets)
    def forget(self, tk: TargetKey) -> None:
        for w in self.workers:
            w.forget(tk)
        self.reference.forget(tk)
        self.model.forget(tk)

    @invariant()
    def every_worker_sees_one_process(self) -> None:
        for k, w in enumerate(self.workers):
            w.refresh()
            for t in TARGETS:
                want = self.model.figures(t)
                assert figures(self.reference.get(t)) == want, t
                assert figures(w.get(t)) == want, (k, t)
            assert w.total_in_flight() == self.reference.total_in_flight() == self.model.total_in_flight()

    @invariant()
    def a_worker_knows_only_its_own_requests(self) -> None:
        for k, w in enumerate(self.workers):
            for key, r in self.model.reqs.items():
                if key.startswith(f"w{k}:"):
                    assert w.instance_of(RequestId(key.split(":", 1)[1])) == r.target


TestSharedLoadTrackerAgainstOneProcess = SharedLoadMachine.TestCase
TestSharedLoadTrackerAgainstOneProcess.settings = settings(
    max_examples=30, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck)
)
