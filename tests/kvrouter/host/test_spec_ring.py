"""Speculative entries between a host's workers: each worker's ring against a list of what was pushed.

A reader that keeps up gets every other worker's entries (and placement records) exactly once, in each
writer's order, across the ring's wrap; a reader lapped by a writer gets a subset of them and counts what
it lost; nobody reads its own.
"""

from __future__ import annotations

import threading

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from indexer import SourceKey
from indexer.indexer import SpeculativeEntry
from kvrouter.host import HostLayout, HostMemory, SpeculativeRings
from kvrouter.host.spec_ring import PeerEntry

WORKERS = 3


def host(ring_words: int) -> list[SpeculativeRings]:
    layout = HostLayout(workers=WORKERS, targets=4, instances=4, ring_words=ring_words)
    mem = HostMemory(layout, bytearray(layout.size()), threading.Lock())
    return [SpeculativeRings(mem, k) for k in range(WORKERS)]


def entry(i: int, n: int) -> SpeculativeEntry:
    return SpeculativeEntry(
        SourceKey(f"inst{i % 3}", i % 2), np.arange(i * 100, i * 100 + n, dtype=np.int64), float(i) + 0.25
    )


Key = tuple[str, int, tuple[int, ...], float, bool, int]


def key(source: SourceKey, chains: np.ndarray, now: float, from_replica: bool, placed: int = 0) -> Key:
    return (source.instance, source.dp_rank, tuple(chains.tolist()), now, from_replica, placed)


def got_key(p: PeerEntry) -> Key:
    return key(p.source, p.chains, p.now, p.from_replica, p.placed)


steps = st.lists(
    st.tuples(
        st.integers(0, WORKERS - 1),
        st.integers(1, 12),
        st.booleans(),
        st.sampled_from(["worker", "replica", "placed"]),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(steps=steps, ring_words=st.sampled_from([40, 64, 4096]))
def test_readers_get_the_others_entries_once_in_order(
    steps: list[tuple[int, int, bool, str]], ring_words: int
) -> None:
    """... with each entry's origin (a worker of this host, or another router replica) kept, and a
    placement record's blocks (a new prompt a worker placed: no chains)."""
    rings = host(ring_words)
    pushed: list[list[Key]] = [[] for _ in range(WORKERS)]
    got: list[list[Key]] = [[] for _ in range(WORKERS)]
    for i, (writer, n, pull_now, kind) in enumerate(steps):
        e = entry(i, n)
        if kind == "placed":
            rings[writer].push_placed(e.source, 100 * i + n, e.now)
            pushed[writer].append(key(e.source, np.empty(0, dtype=np.int64), e.now, False, 100 * i + n))
        else:
            rings[writer].push([e], from_replica=kind == "replica")
            if 6 + n <= ring_words:
                pushed[writer].append(key(e.source, e.chains, e.now, kind == "replica"))
        if pull_now:
            for k in range(WORKERS):
                got[k] += [got_key(p) for p in rings[k].pull()]
    for k in range(WORKERS):
        got[k] += [got_key(p) for p in rings[k].pull()]
        others = [e for w in range(WORKERS) if w != k for e in pushed[w]]
        assert all(g in others for g in got[k])
        assert len(got[k]) == len(set(got[k]))  # every entry is distinct (the index i): none twice
        for w in range(WORKERS):
            mine = [g for g in got[k] if g in pushed[w]]
            assert mine == [e for e in pushed[w] if e in mine], "a writer's order is kept"
            if w == k:
                assert not mine
        if rings[k].lost == 0:
            assert sorted(got[k]) == sorted(others)


def test_a_big_ring_read_often_loses_nothing() -> None:
    rings = host(1 << 12)
    for i in range(500):
        rings[i % WORKERS].push([entry(i, 1 + i % 9)])
        for r in rings:
            r.pull()
    assert [r.lost for r in rings] == [0, 0, 0]


def test_a_lapped_reader_counts_what_it_lost() -> None:
    rings = host(64)
    for i in range(40):
        rings[0].push([entry(i, 8)])
    got = rings[1].pull()
    assert rings[1].lost >= 1
    assert len(got) < 40
