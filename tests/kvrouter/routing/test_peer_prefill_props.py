"""Other replicas' queued prefill per target (``PeerPrefill``) against a plain reference model, on a real
index whose blocks are stored and evicted between the reads.

Reference: an entry is live from its ``add`` until a read of its source finds its last block stored there
or its expiry passed (once found stored it stays done, even if evicted later); a read returns block size x
the distinct blocks of the source's live entries.  ``add`` drops the source's expired entries and keeps the
newest ``max_entries``."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from indexer import Indexer, SourceKey
from indexer.types import Medium
from kvrouter.routing.peer_prefill import PeerPrefill

BS = 16
SOURCES = [SourceKey("a", 0), SourceKey("a", 1), SourceKey("b", 0)]
MAX = 4


class Model:
    def __init__(self) -> None:
        self.entries: dict[SourceKey, list[tuple[tuple[int, ...], float]]] = {s: [] for s in SOURCES}
        self.stored: set[tuple[SourceKey, int]] = set()

    def add(self, s: SourceKey, chains: tuple[int, ...], expiry: float, now: float) -> None:
        if not chains or expiry <= now:
            return
        es = [*self.entries[s], (chains, expiry)]
        if len(es) > MAX or any(e <= now for _, e in es):
            es = [(c, e) for c, e in es[-MAX:] if e > now]
        self.entries[s] = es

    def tokens(self, s: SourceKey, now: float) -> int:
        self.entries[s] = [(c, e) for c, e in self.entries[s] if (s, c[-1]) not in self.stored and e > now]
        return BS * len({c for chains, _ in self.entries[s] for c in chains})


def chains_of(base: int, lo: int, n: int) -> tuple[int, ...]:
    """Blocks lo .. lo + n of one of a few prompts (entries of one prompt overlap)."""
    return tuple(base * 1000 + i for i in range(lo, lo + n))


op = st.one_of(
    st.tuples(
        st.just("add"),
        st.sampled_from(SOURCES),
        st.integers(0, 2),  # prompt
        st.integers(0, 6),  # first block
        st.integers(0, 5),  # blocks
        st.floats(-0.5, 3.0),  # time to live
    ),
    st.tuples(st.just("store"), st.sampled_from(SOURCES), st.integers(0, 2), st.integers(0, 10)),
    st.tuples(st.just("evict"), st.sampled_from(SOURCES), st.integers(0, 2), st.integers(0, 10)),
    st.tuples(st.just("read"), st.sampled_from(SOURCES), st.floats(0.0, 1.0)),
)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(op, max_size=60))
def test_peer_prefill_against_the_model(ops: list[tuple[object, ...]]) -> None:
    ix = Indexer(BS)
    for s in SOURCES:
        ix.register(s)
    pp = PeerPrefill(BS, max_entries=MAX)
    model = Model()
    now = 0.0
    for o in ops:
        match o:
            case ("add", SourceKey() as s, int(base), int(lo), int(n), float(ttl)):
                chains = chains_of(base, lo, n)
                pp.add(s, np.array(chains, dtype=np.int64), expiry=now + ttl, now=now)
                model.add(s, chains, now + ttl, now)
            case ("store", SourceKey() as s, int(base), int(i)):
                c = chains_of(base, i, 1)[0]
                if (s, c) not in model.stored:
                    ix.index.store(s, np.array([c]), np.array([c]), Medium.GPU)
                    model.stored.add((s, c))
            case ("evict", SourceKey() as s, int(base), int(i)):
                c = chains_of(base, i, 1)[0]
                if (s, c) in model.stored:
                    ix.index.remove(s, np.array([c]), Medium.GPU)
                    model.stored.discard((s, c))
            case ("read", SourceKey() as s, float(dt)):
                now += dt
                assert pp.tokens(s, now, ix) == model.tokens(s, now), o
    for s in SOURCES:
        assert pp.tokens(s, now, ix) == model.tokens(s, now)
    assert pp.entries() == sum(len(es) for es in model.entries.values())


def test_an_entry_ends_when_its_last_block_is_stored_not_before() -> None:
    ix = Indexer(BS)
    s = SourceKey("a", 0)
    pp = PeerPrefill(BS)
    pp.add(s, np.arange(10, 20, dtype=np.int64), expiry=5.0, now=0.0)
    pp.add(s, np.arange(10, 22, dtype=np.int64), expiry=5.0, now=0.0)  # the same prompt, two blocks more
    assert pp.tokens(s, 0.1, ix) == 12 * BS  # distinct blocks: the shared ten count once
    ix.index.store(s, np.arange(10, 19), np.arange(10, 19), Medium.GPU)
    assert pp.tokens(s, 0.2, ix) == 12 * BS  # nine of ten stored: still prefilling
    ix.index.store(s, np.array([19]), np.array([19]), Medium.GPU)
    assert pp.tokens(s, 0.3, ix) == 12 * BS  # the first is done; the second lists every block still
    ix.index.store(s, np.array([21]), np.array([21]), Medium.GPU)
    assert pp.tokens(s, 0.4, ix) == 0 and pp.entries() == 0
    pp.add(s, np.arange(30, 33, dtype=np.int64), expiry=1.0, now=0.5)
    assert pp.tokens(s, 0.9, ix) == 3 * BS and pp.tokens(s, 1.0, ix) == 0  # its expiry ends it too
