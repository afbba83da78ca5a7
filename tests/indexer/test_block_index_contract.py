"""The ``BlockIndex`` contract: literal tests with tiny hashes, then a Hypothesis state machine against a
plain reference model (index level; ``test_index_props`` holds the payload-level machine)."""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from indexer import Indexer, SourceKey, SourceOverCapacity
from indexer.index import BlockIndex
from indexer.types import Medium

A, B, C = SourceKey("a", 0), SourceKey("a", 1), SourceKey("b", 0)
GPU, CPU, STO = Medium.GPU, Medium.CPU, Medium.STORAGE
Factory = Callable[..., BlockIndex]


def arr(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


@pytest.fixture
def make_index() -> Factory:
    return lambda cap=1_000_000: BlockIndex(max_blocks_per_source=cap)


def view(ix: BlockIndex, chains: np.ndarray) -> dict[SourceKey, tuple[int, int, int, int, int]]:
    return {m.source: (m.blocks, m.gpu, m.cpu, m.storage, m.speculative) for m in ix.match(chains)}


# ---------------------------------------------------------------------------------------------- literal
def test_store_then_match_counts_leading_blocks(make_index: Factory) -> None:
    ix = make_index()
    ix.store(A, arr(11, 12, 13), arr(1, 2, 3), GPU)
    ix.store(C, arr(21), arr(1), GPU)
    assert view(ix, arr(1, 2, 3, 4)) == {A: (3, 3, 0, 0, 0), C: (1, 1, 0, 0, 0)}
    assert view(ix, arr(9, 1, 2)) == {}
    assert view(ix, arr()) == {}
    assert ix.blocks(A) == {GPU: 3, CPU: 0, STO: 0} and ix.total_entries() == 4
    assert set(ix.sources()) == {A, C}


def test_a_hole_ends_the_match(make_index: Factory) -> None:
    ix = make_index()
    ix.store(A, arr(11, 12, 13, 14), arr(1, 2, 3, 4), GPU)
    ix.remove(A, arr(12), GPU)  # vLLM's LRU may evict a parent and keep its children
    ix.store(B, arr(31, 32), arr(1, 2), GPU)
    assert view(ix, arr(1, 2, 3, 4)) == {A: (1, 1, 0, 0, 0), B: (2, 2, 0, 0, 0)}


def test_each_block_counts_once_in_its_best_tier(make_index: Factory) -> None:
    ix = make_index()
    ix.store(A, arr(11, 12, 13, 14), arr(1, 2, 3, 4), CPU)
    ix.store(A, arr(11, 12), arr(1, 2), GPU)
    ix.store(A, arr(14), arr(4), STO)
    ix.add_speculative(A, arr(5), now=0.0, ttl=10.0)
    assert view(ix, arr(1, 2, 3, 4, 5, 6)) == {A: (5, 2, 2, 0, 1)}
    assert ix.blocks(A) == {GPU: 2, CPU: 4, STO: 1}


def test_references_and_engine_ids(make_index: Factory) -> None:
    ix = make_index()
    ix.store(A, arr(11, 12), arr(1, 2), GPU)
    ix.store(A, arr(11), arr(1), GPU)  # a duplicate store: two references
    ix.store(A, arr(11), arr(1), CPU)
    assert ix.engine_chain(A, 11) == 1 and ix.engine_chain(A, 99) is None
    assert ix.remove(A, arr(11, 99), GPU) == 1  # 99 is unknown
    assert view(ix, arr(1, 2)) == {A: (2, 2, 0, 0, 0)}
    assert ix.remove(A, arr(11), GPU) == 0
    assert view(ix, arr(1, 2)) == {A: (2, 1, 1, 0, 0)}  # block 1 now only in CPU
    assert ix.remove(A, arr(11), GPU) == 1  # no GPU reference left
    assert ix.engine_chain(A, 11) == 1  # still held in CPU
    assert ix.remove(A, arr(11), CPU) == 0
    assert ix.engine_chain(A, 11) is None and ix.blocks(A) == {GPU: 1, CPU: 0, STO: 0}
    assert ix.remove(SourceKey("nobody", 0), arr(1, 2), GPU) == 2


def test_every_reference_needs_its_own_removal(make_index: Factory) -> None:
    ix = make_index()
    for _ in range(3):
        ix.store(A, arr(11), arr(1), STO)
    assert [ix.remove(A, arr(11), STO) for _ in range(4)] == [0, 0, 0, 1]
    assert view(ix, arr(1)) == {} and ix.blocks(A)[STO] == 0


def test_clear_keeps_the_source_listed_and_drop_forgets_it(make_index: Factory) -> None:
    ix = make_index()
    ix.store(A, arr(*range(100, 120)), arr(*range(1, 21)), GPU)  # more than one GC chunk
    ix.store(B, arr(31, 32), arr(1, 2), GPU)
    ix.add_speculative(A, arr(50), now=0.0, ttl=10.0)
    ix.clear_source(A)
    assert view(ix, arr(*range(1, 21))) == {B: (2, 2, 0, 0, 0)}
    assert view(ix, arr(50)) == {}
    assert A in ix.sources() and ix.blocks(A) == {GPU: 0, CPU: 0, STO: 0}
    assert ix.engine_chain(A, 100) is None and ix.speculative_entries() == 0
    ix.store(A, arr(101), arr(1), GPU)
    assert view(ix, arr(1, 2)) == {A: (1, 1, 0, 0, 0), B: (2, 2, 0, 0, 0)}
    ix.drop_source(B)
    ix.store(C, arr(41, 42, 43), arr(1, 2, 3), GPU)  # may reuse B's slot: none of B may show through
    assert B not in ix.sources() and view(ix, arr(1, 2, 3)) == {A: (1, 1, 0, 0, 0), C: (3, 3, 0, 0, 0)}
    ix.clear_source(SourceKey("nobody", 0))
    ix.drop_source(SourceKey("nobody", 0))
    assert SourceKey("nobody", 0) not in ix.sources()


def test_speculative_entries_count_until_confirmed_or_expired(make_index: Factory) -> None:
    ix = make_index()
    ix.add_speculative(A, arr(1, 2, 3), now=100.0, ttl=5.0)
    ix.add_speculative(C, arr(1), now=101.0, ttl=5.0)
    assert view(ix, arr(1, 2, 3)) == {A: (3, 0, 0, 0, 3), C: (1, 0, 0, 0, 1)}
    ix.store(A, arr(11, 12), arr(1, 2), GPU)  # confirms A's first two blocks, not C's
    assert view(ix, arr(1, 2, 3)) == {A: (3, 2, 0, 0, 1), C: (1, 0, 0, 0, 1)}
    assert ix.speculative_entries() == 2
    ix.expire(104.9)
    assert view(ix, arr(1, 2, 3)) == {A: (3, 2, 0, 0, 1), C: (1, 0, 0, 0, 1)}
    ix.expire(105.0)  # an entry whose expiry is <= now no longer counts
    assert view(ix, arr(1, 2, 3)) == {A: (2, 2, 0, 0, 0), C: (1, 0, 0, 0, 1)}
    ix.add_speculative(C, arr(1), now=105.5, ttl=5.0)  # a re-send extends it
    ix.expire(106.0)
    assert view(ix, arr(1, 2, 3)) == {A: (2, 2, 0, 0, 0), C: (1, 0, 0, 0, 1)}
    assert ix.speculative_entries() == 1
    ix.expire(110.5)
    assert view(ix, arr(1)) == {A: (1, 1, 0, 0, 0)} and ix.speculative_entries() == 0


def test_entries_with_shorter_ttls_added_later_expire_first(make_index: Factory) -> None:
    """Peers' entries arrive with what is left of their TTL: expiry must not assume insertion order."""
    ix = make_index()
    ix.add_speculative(A, arr(1), now=0.0, ttl=5.0)
    ix.add_speculative(B, arr(1), now=1.0, ttl=1.0)
    ix.expire(2.5)
    assert view(ix, arr(1)) == {A: (1, 0, 0, 0, 1)}


def test_capacity_is_enforced_per_source_and_medium(make_index: Factory) -> None:
    ix = make_index(cap=3)
    ix.store(A, arr(11, 12, 13), arr(1, 2, 3), GPU)
    with pytest.raises(SourceOverCapacity):
        ix.store(A, arr(14), arr(4), GPU)
    ix.store(A, arr(14), arr(4), CPU)
    ix.store(B, arr(11, 12, 13), arr(1, 2, 3), GPU)
    assert ix.blocks(A) == {GPU: 3, CPU: 1, STO: 0}


def test_the_indexer_reads_what_it_stored() -> None:
    from indexer.encode import PayloadEncoder

    ix = Indexer(4)
    enc = PayloadEncoder()
    toks = list(range(1, 13))
    ix.apply_payload("v", enc.batch([enc.stored([1, 2], None, toks[:8], 4)], ts=1.0))
    ix.apply_payload("v", enc.batch([enc.stored([3], 2, toks[8:], 4)], ts=1.0))
    (m,) = ix.lookup([*toks, 99]).instances
    assert (m.matched_blocks, m.tiers["GPU"], m.trust) == (3, 3, "exact")
    ix.add_speculative(SourceKey("w", 0), ix.chain_hashes(toks), now=0.0)
    res = {x.instance: x.matched_blocks for x in ix.lookup_chains(ix.chain_hashes(toks), 12).instances}
    assert res == {"v": 3, "w": 3}


# ---------------------------------------------------------------------------------------------- model
class RefIndex:
    """Per source: chain -> {medium: references}, engine -> chain, chain -> speculative expiry."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.held: dict[SourceKey, dict[int, dict[Medium, int]]] = {}
        self.engines: dict[SourceKey, dict[int, int]] = {}
        self.spec: dict[SourceKey, dict[int, float]] = {}

    def _src(self, s: SourceKey) -> None:
        self.held.setdefault(s, {})
        self.engines.setdefault(s, {})
        self.spec.setdefault(s, {})

    def store(self, s: SourceKey, engines: list[int], chains: list[int], m: Medium) -> bool:
        self._src(s)
        if self.blocks(s)[m] + len(chains) > self.cap:
            return False
        for e, c in zip(engines, chains):
            media = self.held[s].setdefault(c, {})
            media[m] = media.get(m, 0) + 1
            self.engines[s][e] = c
            self.spec[s].pop(c, None)
        return True

    def remove(self, s: SourceKey, engines: list[int], m: Medium) -> int:
        unknown = 0
        for e in engines:
            c = self.engines.get(s, {}).get(e)
            media = self.held.get(s, {}).get(c, {}) if c is not None else {}
            if not media.get(m):
                unknown += 1
                continue
            media[m] -= 1
            if not media[m]:
                del media[m]
                if not media:
                    del self.held[s][c]  # type: ignore[arg-type]
                    del self.engines[s][e]
        return unknown

    def expire(self, now: float) -> None:
        for sp in self.spec.values():
            for c in [c for c, t in sp.items() if t <= now]:
                del sp[c]

    def blocks(self, s: SourceKey) -> dict[Medium, int]:
        out = dict.fromkeys(Medium, 0)
        for media in self.held.get(s, {}).values():
            for m in media:
                out[m] += 1
        return out

    def match(self, chains: list[int]) -> dict[SourceKey, tuple[int, int, int, int, int]]:
        out = {}
        for s in self.held:
            tiers = [0, 0, 0, 0]
            for c in chains:
                media = self.held[s].get(c, {})
                best = min(media, default=None)
                if best is None and c not in self.spec[s]:
                    break
                tiers[3 if best is None else int(best)] += 1
            if sum(tiers):
                out[s] = (sum(tiers), *tiers)
        return out  # type: ignore[return-value]


SEQS_SOURCES = [A, B, C]


class BackendMachine(RuleBasedStateMachine):
    factory: Factory

    @initialize(seed=st.integers(0, 2**32 - 1))
    def setup(self, seed: int) -> None:
        rng = random.Random(seed)
        trunk = [rng.randrange(-(2**63), 2**63) for _ in range(6)]
        self.seqs = [
            trunk[: rng.randint(1, 6)] + [rng.randrange(-(2**63), 2**63) for _ in range(rng.randint(0, 4))]
            for _ in range(5)
        ]
        self.ix = self.factory(cap=12)
        self.ref = RefIndex(12)
        self.now = 1000.0

    @staticmethod
    def engine(s: SourceKey, c: int) -> int:
        return hash((s, "engine", c)) & ((1 << 63) - 1)

    @rule(s=st.sampled_from(SEQS_SOURCES), k=st.integers(0, 4), lo=st.integers(0, 9), n=st.integers(1, 5),
          m=st.sampled_from([GPU, GPU, CPU, STO]), dup=st.booleans())  # fmt: skip
    def store(self, s: SourceKey, k: int, lo: int, n: int, m: Medium, dup: bool) -> None:
        seq = self.seqs[k]
        lo = min(lo, len(seq) - 1)
        chains = seq[lo : lo + n]
        engines = [self.engine(s, c) for c in chains]
        for _ in range(2 if dup else 1):
            ok = self.ref.store(s, engines, chains, m)
            try:
                self.ix.store(s, arr(*engines), arr(*chains), m)
                assert ok
            except SourceOverCapacity:
                assert not ok

    @rule(
        s=st.sampled_from(SEQS_SOURCES), data=st.data(), m=st.sampled_from(list(Medium)), junk=st.booleans()
    )
    def remove(self, s: SourceKey, data: st.DataObject, m: Medium, junk: bool) -> None:
        held = sorted(self.ref.engines.get(s, {}))
        engines = data.draw(st.lists(st.sampled_from(held), max_size=4, unique=True)) if held else []
        if junk:
            engines.append(12345)
        assert self.ix.remove(s, arr(*engines), m) == self.ref.remove(s, engines, m)

    @rule(s=st.sampled_from(SEQS_SOURCES), k=st.integers(0, 4), n=st.integers(1, 6), ttl=st.floats(0.5, 5))
    def speculative(self, s: SourceKey, k: int, n: int, ttl: float) -> None:
        chains = self.seqs[k][:n]
        self.ref.expire(self.now)
        self.ref._src(s)
        for c in chains:
            self.ref.spec[s][c] = self.now + ttl
        self.ix.add_speculative(s, arr(*chains), now=self.now, ttl=ttl)

    @rule(dt=st.sampled_from([0.25, 1.0, 3.0]))
    def tick(self, dt: float) -> None:
        self.now += dt
        self.ix.expire(self.now)
        self.ref.expire(self.now)

    @rule(s=st.sampled_from(SEQS_SOURCES))
    def clear(self, s: SourceKey) -> None:
        self.ix.clear_source(s)
        if s in self.ref.held:
            self.ref.held[s], self.ref.engines[s], self.ref.spec[s] = {}, {}, {}

    @rule(s=st.sampled_from(SEQS_SOURCES))
    def drop(self, s: SourceKey) -> None:
        self.ix.drop_source(s)
        for d in (self.ref.held, self.ref.engines, self.ref.spec):
            d.pop(s, None)  # type: ignore[attr-defined]

    @invariant()
    def agrees(self) -> None:
        if not hasattr(self, "ix"):
            return
        for seq in self.seqs:
            want = self.ref.match([*seq, 7])
            assert view(self.ix, arr(*seq, 7)) == want, (seq, want)
        assert set(self.ix.sources()) == set(self.ref.held)
        for s in SEQS_SOURCES:
            assert self.ix.blocks(s) == self.ref.blocks(s)
            for e, c in list(self.ref.engines.get(s, {}).items())[:3]:
                assert self.ix.engine_chain(s, e) == c
        assert self.ix.speculative_entries() == sum(len(v) for v in self.ref.spec.values())
        assert self.ix.total_entries() == sum(sum(self.ref.blocks(s).values()) for s in self.ref.held)


_SETTINGS = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck)
)


def test_backend_against_the_reference_model(make_index: Factory) -> None:
    machine = type("Machine", (BackendMachine,), {"factory": staticmethod(make_index)})
    run_state_machine_as_test(machine, settings=_SETTINGS)


def test_reference_model_sanity() -> None:
    ref = RefIndex(10)
    ref.store(A, [11, 12], [1, 2], GPU)
    ref.spec[A][3] = 5.0
    assert ref.match([1, 2, 3, 4]) == {A: (3, 2, 0, 0, 1)}
    assert ref.remove(A, [12, 12], GPU) == 1 and ref.match([1, 2]) == {A: (1, 1, 0, 0, 0)}
