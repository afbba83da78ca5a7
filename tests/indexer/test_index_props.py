"""The index against a plain reference model, under random store / remove / duplicate / clear / hole
sequences, several sources and media, salts, offload placeholders and speculative entries."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize

from indexer import Indexer, SourceKey
from indexer.encode import RELEASES, PayloadEncoder
from indexer.index import SPECULATIVE_BIT, BlockIndex
from tests.support.index_model import BS, SOURCES, IndexMachine

TestIndexAgainstReference = IndexMachine.TestCase
TestIndexAgainstReference.settings = settings(
    max_examples=80, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)
)


class ManyGroupsMachine(IndexMachine):
    """The same histories with the three sources in three groups of 64 (filler slots between them), so
    payloads take the ingest's fast path into groups other than the first."""

    @initialize(seed=st.integers(0, 2**32 - 1), release=st.sampled_from(RELEASES[RELEASES.index("0.20.0") :]))
    def setup(self, seed: int, release: str) -> None:
        IndexMachine.setup(self, seed, release)
        ix = self.ix.index
        assert isinstance(ix, BlockIndex)
        for i, s in enumerate(SOURCES):
            for f in range(70 * i):
                ix.slot_of(SourceKey(f"filler{i}", f))
            ix.slot_of(s)


TestManyGroupsAgainstReference = ManyGroupsMachine.TestCase
TestManyGroupsAgainstReference.settings = settings(
    max_examples=30, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck)
)


def test_speculative_entries_count_until_confirmed_or_expired() -> None:
    ix = Indexer(BS)
    enc = PayloadEncoder()
    src = SourceKey("a", 0)
    toks = list(range(1, 13))
    chains = ix.chain_hashes(toks)
    ix.add_speculative(src, chains, now=100.0)
    (m,) = ix.lookup(toks, now=100.5).instances
    assert (m.matched_blocks, m.speculative_blocks, m.tiers["GPU"]) == (3, 3, 0)
    # events confirm the first two blocks: they now count as GPU, the third stays speculative
    ix.apply_payload("a", enc.batch([enc.stored([11, 12], None, toks[:8], BS)], ts=1.0))
    (m,) = ix.lookup(toks, now=101.0).instances
    assert (m.matched_blocks, m.speculative_blocks, m.tiers["GPU"]) == (3, 1, 2)
    assert ix.index.speculative_entries() == 1
    # after the TTL the unconfirmed block no longer counts
    (m,) = ix.lookup(toks, now=100.0 + ix.speculative_ttl + 0.01).instances
    assert (m.matched_blocks, m.speculative_blocks) == (2, 0)
    assert ix.index.speculative_entries() == 0
    # a different salt never sees them
    ix.add_speculative(src, chains, now=200.0)
    assert ix.lookup(toks, cache_salt="other", now=200.1).instances[0].matched_blocks == 0


def test_salt_and_lora_from_events_match_requests() -> None:
    ix = Indexer(BS)
    enc = PayloadEncoder()
    toks = list(range(1, 9))
    ev = enc.stored([1, 2], None, toks, BS, lora_name="ad", extra_keys=[("ad", "s1"), ("ad",)])
    ix.apply_payload("a", enc.batch([ev], ts=1.0))
    assert ix.lookup(toks, lora_name="ad", cache_salt="s1").instances[0].matched_blocks == 2
    assert ix.lookup(toks, lora_name="ad").instances[0].matched_blocks == 0
    assert ix.lookup(toks, cache_salt="s1").instances[0].matched_blocks == 0
    assert ix.lookup(toks).instances[0].matched_blocks == 0
    # multimodal-style extra keys make a block unmatchable by text requests, not a wrong match
    ev2 = enc.stored([3, 4], None, toks, BS, extra_keys=[("img-hash",), None])
    ix.apply_payload("b", enc.batch([ev2], ts=1.0))
    assert ix.lookup(toks).instances[1].matched_blocks == 0


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(SOURCES),
            st.lists(st.integers(0, 60), min_size=1, max_size=40, unique=True),  # across _SMALL_BATCH
            st.sampled_from([1.0, 5.0]),  # ttl: a later, shorter one replaces a longer one
            st.floats(0.0, 3.0),  # time since the previous operation
            st.booleans(),  # then an explicit expire
        ),
        max_size=30,
    )
)
def test_speculative_entries_against_a_reference(
    ops: list[tuple[SourceKey, list[int], float, float, bool]],
) -> None:
    """Speculative entries (per-key and vectorised updates alike) against a dict of expiries: an entry
    counts while its latest expiry is after now; a source's bit is set in the group map exactly for the
    chains it holds."""
    ix = Indexer(BS).index
    ref: dict[tuple[SourceKey, int], float] = {}
    now = 0.0
    for src, keys, ttl, dt, expire_after in ops:
        now += dt
        chains = np.array([k * 7_919 + 1 for k in keys], dtype=np.int64)
        ix.add_speculative(src, chains, now=now, ttl=ttl)
        ref = {k: e for k, e in ref.items() if e > now}
        ref.update({(src, int(c)): now + ttl for c in chains})
        if expire_after:
            now += dt
            ix.expire(now)
            ref = {k: e for k, e in ref.items() if e > now}
        for s in SOURCES:
            held = {c for (rs, c) in ref if rs == s}
            # through the public lookup too: every held chain matches this source (speculative, one block)
            for c in sorted(held)[:3]:
                found = {(m.source, m.blocks, m.speculative) for m in ix.match(np.array([c], dtype=np.int64))}
                assert (s, 1, 1) in found, (s, c, found)
            if s not in ix._slots:
                assert held == set(), f"{s} holds entries but has no slot"
                continue
            slot = ix._slots[s]
            exp = ix._spec_expiry.get(slot)
            got = {c for c in (exp if exp is not None else []) if exp[c] > now}
            assert got == held, (s, sorted(got ^ held))
            smap, bit = ix._spec[slot // 64], 1 << (slot % 64)
            with_bit = {c for c in smap if smap[c] & bit}
            # expired-but-not-yet-dropped entries may linger until the next expire(): only as <= now
            assert held <= with_bit and all(exp[c] <= now for c in with_bit - held), s
            # ``holding`` shows the speculative bit exactly where the group map has it (no medium: no events)
            probe = np.array(sorted(with_bit | {1, 2}), dtype=np.int64)
            bits = ix.holding(s, probe).tolist()
            assert bits == [SPECULATIVE_BIT if c in with_bit else 0 for c in probe.tolist()], s
