"""The index with many groups of 64 sources, against a plain reference model.

Chains are drawn from a small pool, so most are held by sources of several groups at once (the case the
fleet-wide chain table keeps as ordinals), and tiers, duplicates, removals, clears, dropped and reused
slots and speculative entries all mix.  The second test checks the lookup answers kept by ``Indexer``
(``indexer.answers``) against answers built afresh, across trust changes and sources coming and going.
"""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Any

import msgspec
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from indexer import Indexer, SourceKey, Trust
from indexer.encode import PayloadEncoder
from indexer.index import BlockIndex
from indexer.types import Medium

N_SOURCES = 200  # four groups of 64
POOL = [((i * 0x9E3779B97F4A7C15) & ((1 << 63) - 1)) - (i % 3) * (1 << 62) for i in range(1, 41)]
KINDS = (Medium.GPU, Medium.CPU, Medium.STORAGE)


def engine_of(src: int, chain: int) -> int:
    """vLLM's ids of the same block agree across instances unless their seeds differ: half of the
    sources share ids, the others have their own."""
    return chain ^ (src * 7919 if src % 2 else 0)


class Model:
    """Per source: chain -> {medium: references}; speculative chain -> expiry."""

    def __init__(self) -> None:
        self.refs: dict[int, dict[int, dict[Medium, int]]] = defaultdict(dict)
        self.spec: dict[int, dict[int, float]] = defaultdict(dict)

    def store(self, s: int, chains: list[int], m: Medium) -> None:
        for c in chains:
            held = self.refs[s].setdefault(c, {})
            held[m] = held.get(m, 0) + 1
            self.spec[s].pop(c, None)

    def remove(self, s: int, chains: list[int], m: Medium) -> int:
        unknown = 0
        for c in chains:
            held = self.refs[s].get(c)
            if not held or not held.get(m):
                unknown += 1
                continue
            held[m] -= 1
            if not held[m]:
                del held[m]
            if not held:
                del self.refs[s][c]
        return unknown

    def expire(self, now: float) -> None:
        for s in self.spec:
            self.spec[s] = {c: e for c, e in self.spec[s].items() if e > now}

    def match(self, chains: list[int]) -> dict[int, tuple[int, int, int, int, int]]:
        out = {}
        for s in set(self.refs) | set(self.spec):
            tiers = [0, 0, 0, 0]
            depth = 0
            for c in chains:
                held = self.refs[s].get(c, {})
                if held:
                    tiers[min(held)] += 1
                elif c in self.spec[s]:
                    tiers[3] += 1
                else:
                    break
                depth += 1
            if depth:
                out[s] = (depth, *tiers)
        return out


def op_strategy() -> st.SearchStrategy[tuple[Any, ...]]:
    src = st.integers(0, N_SOURCES - 1)
    run = st.lists(st.sampled_from(POOL), min_size=1, max_size=12)
    kind = st.sampled_from(KINDS)
    return st.one_of(
        st.tuples(st.just("store"), src, run, kind),
        st.tuples(st.just("store_many"), st.lists(src, min_size=2, max_size=40), run, kind),
        st.tuples(st.just("remove"), src, run, kind),
        st.tuples(st.just("clear"), src),
        st.tuples(st.just("drop"), src),
        st.tuples(st.just("spec"), src, run, st.floats(0.5, 3.0)),
        st.tuples(st.just("expire"), st.floats(0.0, 2.0)),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op_strategy(), min_size=1, max_size=60), st.randoms(use_true_random=False))
def test_many_groups_against_a_reference(ops: list[tuple[Any, ...]], rnd: random.Random) -> None:
    ix = BlockIndex()
    ref = Model()
    keys = [SourceKey(f"i{s // 8}", s % 8) for s in range(N_SOURCES)]
    # every source gets a slot up front, so the fleet spans all four groups whatever the ops
    for k in keys:
        ix.slot_of(k)
    now = 0.0
    for op in ops:
        name = op[0]
        if name in ("store", "store_many"):
            sources = [op[1]] if name == "store" else op[1]
            chains, m = op[2], op[3]
            for s in sources:
                e = np.array([engine_of(s, c) for c in chains], dtype=np.int64)
                ix.store(keys[s], e, np.array(chains, dtype=np.int64), m)
                ref.store(s, chains, m)
        elif name == "remove":
            s, chains, m = op[1], list(dict.fromkeys(op[2])), op[3]
            e = np.array([engine_of(s, c) for c in chains], dtype=np.int64)
            assert ix.remove(keys[s], e, m) == ref.remove(s, chains, m)
        elif name in ("clear", "drop"):
            s = op[1]
            (ix.clear_source if name == "clear" else ix.drop_source)(keys[s])
            ref.refs.pop(s, None)
            ref.spec.pop(s, None)
        elif name == "spec":
            s, chains, ttl = op[1], op[2], op[3]
            ix.add_speculative(keys[s], np.array(chains, dtype=np.int64), now=now, ttl=ttl)
            ref.expire(now)
            ref.spec[s].update({c: now + ttl for c in chains})
        else:
            now += op[1]
            ix.expire(now)
            ref.expire(now)
        query = [rnd.choice(POOL) for _ in range(rnd.randint(1, 6))]
        if rnd.random() < 0.5 and ref.refs:
            # a run some source holds, then one more block
            s = rnd.choice(sorted(ref.refs))
            query = list(ref.refs[s])[: rnd.randint(1, 8)] + query[:1]
        rows = ix.match(np.array(query, dtype=np.int64))
        got = {keys.index(m.source): (m.blocks, m.gpu, m.cpu, m.storage, m.speculative) for m in rows}
        assert got == ref.match(query), (name, query)
        for s in range(N_SOURCES):
            want = {m: sum(1 for h in ref.refs.get(s, {}).values() if h.get(m)) for m in KINDS}
            assert ix.blocks(keys[s]) == want, s
    assert ix.speculative_entries() == sum(len(v) for v in ref.spec.values())


BS = 4


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32))
def test_kept_answers_equal_fresh_ones(seed: int) -> None:
    """150 sources over shared prefixes: every lookup (token list, token array, chains) answers as the
    answer built from scratch, while trust changes, sources leave and join, and speculative entries
    split tiers."""
    rnd = random.Random(seed)
    enc = PayloadEncoder()
    ix = Indexer(BS)
    # Two prefixes over 150 sources: ~75 hold each, past the 64 from which answers start from a kept
    # template (``indexer.answers``), whichever source holds the prompt's tail.
    prefixes = [[rnd.randrange(50_000) for _ in range(BS * 6)] for _ in range(2)]
    prompts = []
    for n in range(150):
        src = SourceKey(f"v{n // 2}", n % 2)
        p = rnd.choice(prefixes)
        tail = [rnd.randrange(50_000) for _ in range(BS * rnd.randint(1, 4))]
        toks = p + tail
        engines = [rnd.getrandbits(63) for _ in range(len(toks) // BS)]
        payload = enc.batch([enc.stored(engines, None, toks, BS)], ts=1.0, dp_rank=src.dp_rank)
        ix.apply_payload(src.instance, payload)
        prompts.append(toks)
    for step in range(40):
        r = rnd.random()
        known = ix.sources()
        if r < 0.2:
            ix.sync(rnd.choice(known)).trust = rnd.choice(list(Trust))
        elif r < 0.3:
            ix.remove_instance(rnd.choice(known).instance)
        elif r < 0.4:
            ix.forget_source(rnd.choice(known))
        elif r < 0.5:
            ix.register(SourceKey(f"new{step}", 0))
        elif r < 0.6:
            src = rnd.choice(known)
            ix.add_speculative(src, ix.chain_hashes(rnd.choice(prompts))[:3], now=float(step))
        toks = [*rnd.choice(prompts + prefixes)[: BS * rnd.randint(1, 10)], 1, 2, 3]
        fresh = ix._result(len(toks), ix.index.match(ix.chain_hashes(toks)))
        for got in (ix.lookup(toks), ix.lookup(np.array(toks, dtype=np.uint32)),
                    ix.lookup_chains(ix.chain_hashes(toks), len(toks))):  # fmt: skip
            assert msgspec.to_builtins(got) == msgspec.to_builtins(fresh), step
    assert isinstance(ix.index, BlockIndex)
