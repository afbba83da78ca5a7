"""Shared stores (``indexer.tiers``) against reference models written here.

1. ``AgeBook`` (a store that announces no removals, bounded by capacity and age) against a list of
   (block, time) in announcement order.
2. The lookup walk with shared stores, at fleet scale (several groups of 64 slots), against a reference
   that walks each source's blocks by hand: a block counts when the source holds it in any kind or a
   store it attaches holds it; its tier is the source's best own kind, else the first such store.
3. ``Indexer`` fed vLLM payloads (GPU stores and removals, STORAGE placeholders and full stores with
   locality REMOTE, CPU stores of an owned tier that announces removals, clears), instances attached to
   some stores and not others, event time advancing: lookups name the tiers the reference says.
"""

from __future__ import annotations

import random
from collections import OrderedDict, defaultdict
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from indexer import Indexer, SourceKey
from indexer.encode import PayloadEncoder
from indexer.index import BlockIndex
from indexer.tiers import AgeBook, SharedStoreConfig, store_source
from indexer.types import Medium

# ---------------------------------------------------------------------------------------------- 1. AgeBook


class RefBook:
    def __init__(self, capacity: int, max_age: float) -> None:
        self.capacity, self.max_age = capacity, max_age
        self.order: list[tuple[int, float]] = []
        self.newest = float("-inf")

    def announce(self, chains: list[int], ts: float) -> tuple[list[int], list[int], list[int]]:
        before = {c for c, _ in self.order}
        self.newest = max(self.newest, ts)
        new = []
        for c in chains:
            self.order = [(x, t) for x, t in self.order if x != c] + [(c, ts)]
            if c not in before and c not in new:
                new.append(c)
        aged = []
        if self.max_age:
            aged = [c for c, t in self.order if t < self.newest - self.max_age]
            self.order = [(c, t) for c, t in self.order if t >= self.newest - self.max_age]
        full = []
        while self.capacity and len(self.order) > self.capacity:
            full.append(self.order.pop(0)[0])
        gone = set(aged) | set(full)
        return (
            [c for c in new if c not in gone],
            [c for c in full if c not in new],
            [c for c in aged if c not in new],
        )


@settings(max_examples=200, deadline=None)
@given(
    capacity=st.sampled_from([0, 1, 3, 8]),
    max_age=st.sampled_from([0.0, 1.0, 4.0]),
    ops=st.lists(
        st.tuples(st.lists(st.integers(0, 12), max_size=6), st.floats(0.0, 3.0), st.booleans()),
        max_size=40,
    ),
)
def test_age_book_against_a_reference(capacity: int, max_age: float, ops: list[Any]) -> None:
    if not capacity and not max_age:
        capacity = 5
    book, ref = AgeBook(capacity, max_age), RefBook(capacity, max_age)
    t = 0.0
    for chains, dt, discard in ops:
        t += dt  # announcement times never go back
        if discard and chains:
            book.discard(chains[:1])
            ref.order = [(c, x) for c, x in ref.order if c != chains[0]]
            continue
        assert book.announce(chains, t) == ref.announce(chains, t)
        assert [c for c in ref.order] == [(c, book._at[c]) for c in book._at]
        assert not capacity or len(book) <= capacity


# ---------------------------------------------------------------------------------- 2. the walk, at scale

N_SOURCES = 150  # three groups of 64
POOL = [((i * 0x9E3779B97F4A7C15) & ((1 << 63) - 1)) - (i % 3) * (1 << 62) for i in range(1, 25)]
INSTANCES = [f"i{s // 8}" for s in range(N_SOURCES)]
KINDS = (Medium.GPU, Medium.CPU, Medium.STORAGE)


def walk_reference(
    held: dict[int, dict[int, set[int]]],
    stores: list[tuple[int, frozenset[str] | None]],
    keys: list[SourceKey],
    chains: list[int],
) -> dict[SourceKey, tuple[int, int, int, int, int, dict[int, int]]]:
    """held[slot][chain]: the kinds (0 GPU, 1 CPU, 2 STORAGE, 3 speculative) the slot holds it in."""
    store_slots = {s for s, _ in stores}
    out = {}
    for slot, key in enumerate(keys):
        if slot in store_slots:
            continue
        tiers = [0, 0, 0, 0]
        shared: dict[int, int] = defaultdict(int)
        depth = 0
        for c in chains:
            own = held[slot].get(c)
            if own:
                tiers[min(own)] += 1
            else:
                via = next(
                    (
                        i
                        for i, (s, names) in enumerate(stores)
                        if held[s].get(c) and (names is None or key.instance in names)
                    ),
                    None,
                )
                if via is None:
                    break
                shared[via] += 1
            depth += 1
        if depth:
            out[key] = (depth, tiers[0], tiers[1], tiers[2], tiers[3], dict(shared))
    return out


def walk_ops() -> st.SearchStrategy[tuple[Any, ...]]:
    slot = st.integers(0, N_SOURCES + 1)  # the last two are the stores
    run = st.lists(st.sampled_from(POOL), min_size=1, max_size=10)
    return st.one_of(
        st.tuples(st.just("store"), slot, run, st.sampled_from(KINDS)),
        st.tuples(
            st.just("store"), st.sampled_from([N_SOURCES, N_SOURCES + 1]), run, st.just(Medium.STORAGE)
        ),
        st.tuples(st.just("remove"), slot, run, st.sampled_from(KINDS)),
        st.tuples(st.just("clear"), slot),
        st.tuples(st.just("spec"), st.integers(0, N_SOURCES - 1), run),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(walk_ops(), min_size=1, max_size=50),
    attach=st.tuples(
        st.one_of(st.none(), st.sets(st.sampled_from(sorted(set(INSTANCES))), max_size=8)),
        st.one_of(st.none(), st.sets(st.sampled_from(sorted(set(INSTANCES))), max_size=8)),
    ),
    prompt=st.lists(st.sampled_from(POOL), min_size=1, max_size=12),
)
def test_walk_credits_stores_as_the_reference(
    ops: list[tuple[Any, ...]], attach: tuple[set[str] | None, set[str] | None], prompt: list[int]
) -> None:
    ix = BlockIndex()
    keys = [SourceKey(INSTANCES[s], s % 8) for s in range(N_SOURCES)] + [
        store_source("l2"),
        store_source("l3"),
    ]
    for k in keys:
        ix.slot_of(k)
    names = [None if a is None else frozenset(a) for a in attach]
    ix.set_shared([(keys[N_SOURCES], names[0]), (keys[N_SOURCES + 1], names[1])])
    held: dict[int, dict[int, set[int]]] = defaultdict(lambda: defaultdict(set))
    refs: dict[tuple[int, int, int], int] = defaultdict(int)
    for op in ops:
        if op[0] == "store":
            _, s, chains, m = op
            ix.store(keys[s], np.array(chains, dtype=np.int64), np.array(chains, dtype=np.int64), m)
            for c in chains:
                held[s][c].add(int(m))
                refs[(s, c, int(m))] += 1
                held[s][c].discard(3)  # confirmed
        elif op[0] == "remove":
            _, s, chains, m = op
            ix.remove(keys[s], np.array(chains, dtype=np.int64), m)
            for c in chains:
                if refs[(s, c, int(m))]:
                    refs[(s, c, int(m))] -= 1
                    if not refs[(s, c, int(m))]:
                        held[s][c].discard(int(m))
        elif op[0] == "clear":
            ix.clear_source(keys[op[1]])
            held[op[1]] = defaultdict(set)
            for ref_key in [r for r in refs if r[0] == op[1]]:
                del refs[ref_key]
        else:
            _, s, chains = op
            ix.add_speculative(keys[s], np.array(chains, dtype=np.int64), now=0.0, ttl=100.0)
            for c in chains:
                if not held[s][c]:
                    held[s][c].add(3)
    for s in held:
        for c in [c for c, kinds in held[s].items() if not kinds]:
            del held[s][c]
    want = walk_reference(held, [(N_SOURCES, names[0]), (N_SOURCES + 1, names[1])], keys, prompt)
    got = {
        m.source: (
            m.blocks,
            m.gpu,
            m.cpu,
            m.storage,
            m.speculative,
            {["l2", "l3"].index(k): v for k, v in m.shared.items()},
        )
        for m in ix.match(np.array(prompt, dtype=np.int64))
    }
    assert got == want


# ------------------------------------------------------------------------------------------ 3. Indexer

BS = 4
SRCS = [SourceKey("a", 0), SourceKey("a", 1), SourceKey("b", 0), SourceKey("c", 0)]
L2 = SharedStoreConfig(
    "l2", medium="STORAGE", locality="REMOTE", instances=["a", "b"], capacity_blocks=6, max_age_s=5.0
)
LMC = SharedStoreConfig("lmc", medium="CPU", ownership="lmcache", announces_removals=True)
MASK = (1 << 64) - 1


def engine(src: SourceKey, key: tuple[int, ...]) -> int:
    return hash((src.instance, "e", key)) & MASK


class Ref:
    """Own tiers per source (engine -> key, {medium: refs}), l2 as an ordered book of keys, lmc as
    references per (writer engine, key)."""

    def __init__(self) -> None:
        self.own: dict[SourceKey, dict[int, tuple[tuple[int, ...], dict[str, int]]]] = defaultdict(dict)
        self.l2: OrderedDict[tuple[int, ...], float] = OrderedDict()
        self.l2_newest = float("-inf")
        self.lmc: dict[int, tuple[tuple[int, ...], int]] = {}

    def key_of(self, src: SourceKey, e: int) -> tuple[int, ...] | None:
        got = self.own[src].get(e)
        return got[0] if got else None

    def l2_announce(self, keys: list[tuple[int, ...]], ts: float) -> None:
        self.l2_newest = max(self.l2_newest, ts)
        for k in keys:
            self.l2.pop(k, None)
            self.l2[k] = ts
        self.l2_age()
        while len(self.l2) > L2.capacity_blocks:
            self.l2.popitem(last=False)

    def l2_age(self) -> None:
        for k in [k for k, t in self.l2.items() if t < self.l2_newest - L2.max_age_s]:
            del self.l2[k]

    def match(self, src: SourceKey, tokens: list[int]) -> tuple[int, dict[str, int]]:
        media: dict[tuple[int, ...], set[str]] = defaultdict(set)
        for key, m in self.own[src].values():
            media[key] |= set(m)
        lmc = {k for k, n in self.lmc.values() if n > 0}
        tiers: dict[str, int] = defaultdict(int)
        depth = 0
        for i in range(len(tokens) // BS):
            key = tuple(tokens[: (i + 1) * BS])
            if media.get(key):
                tiers[next(m for m in ("GPU", "CPU", "STORAGE") if m in media[key])] += 1
            elif src.instance in L2.instances and key in self.l2:  # type: ignore[operator]
                tiers["l2"] += 1
            elif key in lmc:
                tiers["lmc"] += 1
            else:
                break
            depth += 1
        tiers.setdefault("GPU", 0)
        return depth, dict(tiers)


class SharedMachine(RuleBasedStateMachine):
    @initialize(seed=st.integers(0, 2**32 - 1))
    def setup(self, seed: int) -> None:
        rng = random.Random(seed)
        trunk = [tuple(rng.randrange(30) for _ in range(BS)) for _ in range(5)]
        self.seqs = [
            trunk[: rng.randint(1, 5)]
            + [tuple(rng.randrange(30) for _ in range(BS)) for _ in range(rng.randint(0, 3))]
            for _ in range(5)
        ]
        self.enc = PayloadEncoder("0.33.0")
        self.ix = Indexer(BS, shared=[L2, LMC])
        for s in SRCS:
            self.ix.register(s)
        self.ref = Ref()
        self.t = 0.0

    def _keys(self, seq: list[tuple[int, ...]], lo: int, hi: int) -> list[tuple[int, ...]]:
        return [tuple(t for b in seq[: i + 1] for t in b) for i in range(lo, hi)]

    def _apply(self, src: SourceKey, events: list[Any]) -> None:
        self.ix.apply_payload(
            src.instance, self.enc.batch(events, ts=self.t, dp_rank=src.dp_rank), dp_rank=src.dp_rank
        )
        # every batch is news of the time, whoever sends it: the age bound moves with it
        self.ref.l2_newest = max(self.ref.l2_newest, self.t)
        self.ref.l2_age()

    @rule(dt=st.sampled_from([0.0, 0.5, 2.0, 6.0]))
    def time_passes(self, dt: float) -> None:
        self.t += dt

    @rule(s=st.sampled_from(SRCS), k=st.integers(0, 4), n=st.integers(1, 4))
    def gpu_store(self, s: SourceKey, k: int, n: int) -> None:
        seq = self.seqs[k]
        toks = [t for b in seq for t in b]
        lo = min(self.ref.match(s, toks)[1].get("GPU", 0), len(seq) - 1)
        # continue after the GPU prefix (the parent is a GPU block the source holds)
        keys = self._keys(seq, lo, min(lo + n, len(seq)))
        parent = self._keys(seq, lo - 1, lo)[0] if lo else None
        if parent is not None and "GPU" not in self.ref.own[s].get(engine(s, parent), ((), {}))[1]:
            return
        ev = self.enc.stored(
            [engine(s, key) for key in keys],
            None if parent is None else engine(s, parent),
            [t for b in seq[lo : lo + len(keys)] for t in b],
            BS,
        )
        self._apply(s, [ev])
        for key in keys:
            e = engine(s, key)
            _, media = self.ref.own[s].setdefault(e, (key, {}))
            media["GPU"] = media.get("GPU", 0) + 1

    @rule(s=st.sampled_from(SRCS), data=st.data())
    def gpu_evict(self, s: SourceKey, data: st.DataObject) -> None:
        gpu = sorted(e for e, (_, m) in self.ref.own[s].items() if m.get("GPU"))
        if not gpu:
            return
        e = data.draw(st.sampled_from(gpu))
        self._apply(s, [self.enc.removed([e])])
        _, media = self.ref.own[s][e]
        media["GPU"] -= 1
        if not media["GPU"]:
            del media["GPU"]
        if not media:
            del self.ref.own[s][e]

    @rule(s=st.sampled_from(SRCS), data=st.data(), full=st.booleans())
    def write_remote_storage(self, s: SourceKey, data: st.DataObject, full: bool) -> None:
        """A STORAGE REMOTE copy of blocks the source holds: to l2 if it attaches it, else its own."""
        held = sorted(self.ref.own[s].items())
        if not held:
            return
        e, (key, _) = data.draw(st.sampled_from(held))
        if full:
            n = len(key) // BS
            parent = key[:-BS] if n > 1 else None
            pe = None if parent is None else engine(s, parent)
            ev = self.enc.stored([e], pe, list(key[-BS:]), BS, medium="STORAGE", locality="REMOTE")
            if parent is not None and self.ref.key_of(s, pe) is None and self.ref.key_of(s, e) is None:  # type: ignore[arg-type]
                return  # neither the parent nor the block known: skipped (tested elsewhere)
        else:
            ev = self.enc.stored([e], None, [], 0, medium="STORAGE", locality="REMOTE", group_idx=0)
        self._apply(s, [ev])
        if s.instance in L2.instances:  # type: ignore[operator]
            self.ref.l2_announce([key], self.t)
        else:
            _, media = self.ref.own[s][e]
            media["STORAGE"] = media.get("STORAGE", 0) + 1

    # LMCache's writers here are instance a's ranks (one set of engine ids), so each block has one id
    @rule(s=st.sampled_from(SRCS[:2]), data=st.data())
    def lmcache_store(self, s: SourceKey, data: st.DataObject) -> None:
        held = sorted(self.ref.own[s].items())
        if not held:
            return
        e, (key, _) = data.draw(st.sampled_from(held))
        self._apply(s, [self.enc.stored([e], None, [], 0, medium="CPU", ownership="lmcache", group_idx=0)])
        _, n = self.ref.lmc.get(e, (key, 0))
        self.ref.lmc[e] = (key, n + 1)

    @rule(s=st.sampled_from(SRCS[:2]), data=st.data())
    def lmcache_remove(self, s: SourceKey, data: st.DataObject) -> None:
        mine = sorted(e for e in self.ref.lmc if self.ref.lmc[e][1] > 0)
        if not mine:
            return
        e = data.draw(st.sampled_from(mine))
        self._apply(s, [self.enc.removed([e], medium="CPU", ownership="lmcache", group_idx=0)])
        key, n = self.ref.lmc[e]
        # only the writer's own engine ids resolve: other instances' ids differ (seeded per instance)
        if any(engine(x, key) == e for x in SRCS if x.instance == s.instance):
            self.ref.lmc[e] = (key, n - 1)

    @rule(s=st.sampled_from(SRCS))
    def clear(self, s: SourceKey) -> None:
        self._apply(s, [self.enc.cleared()])
        self.ref.own[s] = {}

    @invariant()
    def lookups_agree(self) -> None:
        if not hasattr(self, "ix"):
            return
        for seq in self.seqs:
            toks = [t for b in seq for t in b] + [1]
            res = self.ix.lookup(toks)
            assert res.stores == {"l2": "estimated", "lmc": "exact"}
            by = {SourceKey(m.instance, m.dp_rank): m for m in res.instances}
            for s in SRCS:
                depth, tiers = self.ref.match(s, toks)
                m = by[s]
                assert (m.matched_blocks, m.tiers) == (depth, tiers), (s, toks)


SharedMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
test_indexer_with_shared_stores = SharedMachine.TestCase
