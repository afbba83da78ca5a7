"""The ingest's fast path (``indexer.fast_ingest``: payloads parsed and applied in compiled code) against
the reference path (``BatchDecoder`` then one event at a time), on the same random payload streams.

Two indexers take the same payloads, one with ``fast_ingest`` on and one with it off: after every payload
they must have returned the same count, hold the same counters (events, blocks, clears, every error and
skip reason), answer every lookup alike and report the same blocks per source.  The streams mix every
release's shape, sources in three groups of 64, stored events chained to held, unknown and absent parents,
offload placeholders, removals of held, unknown and repeated hashes, duplicates (further references),
clears, LoRA and salted events (declined by the fast path), wrong block sizes and token counts, batches
naming another rank than the caller's, and payloads with a byte changed or cut short.  A second stream
adds the tiers' wire fields (``locality``, ``ownership``) and offload children sent before their parents,
with and without shared stores configured (the fast path may decline all of it; the results must agree).
"""

from __future__ import annotations

import random
from typing import Any

import msgspec
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from indexer import Indexer, SourceKey
from indexer.encode import RELEASES, PayloadEncoder
from indexer.index import BlockIndex
from indexer.tiers import SharedStoreConfig

BS = 4
# slots 0, 1, 70 and 140: three groups (fillers take the slots between)
SOURCES = [SourceKey("a", 0), SourceKey("a", 1), SourceKey("b", 0), SourceKey("c", 3)]
FILLERS = {2: 68, 3: 69}  # before SOURCES[i], this many filler slots
MEDIA = ["GPU", "GPU", "CPU", "STORAGE", None]
STORES = [
    SharedStoreConfig("l2", medium="STORAGE", instances=["a", "b"], capacity_blocks=6),
    SharedStoreConfig("lmc", medium="CPU", ownership="lmcache", announces_removals=True, max_age_s=30.0),
    SharedStoreConfig("far", medium="CPU", locality="REMOTE", capacity_blocks=4),
]


def make(fast: bool, shared: list[SharedStoreConfig] | None = None) -> Indexer:
    ix = Indexer(BS, fast_ingest=fast, max_blocks_per_source=60, shared=shared)
    assert isinstance(ix.index, BlockIndex)
    if fast:  # tables sized ahead on one side only: what they hold never depends on it
        ix.reserve(150, 20)
    for i, s in enumerate(SOURCES):
        for f in range(FILLERS.get(i, 0)):
            ix.index.slot_of(SourceKey(f"filler{i}", f))
        ix.index.slot_of(s)
    return ix


class Stream:
    """Random payloads for the sources: mostly well-formed, continuing what each source holds."""

    def __init__(self, rnd: random.Random, release: str, *, tiers: bool = False) -> None:
        self.rnd = rnd
        self.tiers = tiers
        self.enc = PayloadEncoder(release)
        self.trunk = [
            rnd.randrange(2**32) if rnd.random() < 0.1 else rnd.randrange(60) for _ in range(BS * 12)
        ]
        self.held: dict[SourceKey, list[int]] = {s: [] for s in SOURCES}  # engine hashes sent, in order
        self.next_engine = 1

    def _engines(self, n: int) -> list[int | bytes]:
        out: list[int | bytes] = []
        for _ in range(n):
            e = self.next_engine * 0x9E3779B97F4A7C15 % (1 << 64)
            self.next_engine += 1
            r = self.rnd.random()
            out.append(e.to_bytes(8, "big") if r < 0.15 else (e - (1 << 64) if r < 0.3 and e >> 63 else e))
        return out

    def _tier_fields(self) -> dict[str, Any]:
        """With ``tiers``: locality and ownership, sometimes (what the shared stores above route by)."""
        rnd = self.rnd
        kw: dict[str, Any] = {}
        if self.tiers and rnd.random() < 0.6:
            kw["locality"] = rnd.choice(["LOCAL", "REMOTE", None])
            kw["ownership"] = rnd.choice(["lmcache", "fs", None])
        return kw

    def event(self, src: SourceKey) -> Any:
        rnd, enc, held = self.rnd, self.enc, self.held[src]
        r = rnd.random()
        medium = rnd.choice(MEDIA)
        tier = self._tier_fields()
        if r < 0.45:
            lo = rnd.randrange(0, 10)
            n = rnd.randint(0, 4)
            toks = (
                self.trunk[lo * BS : (lo + n) * BS]
                if rnd.random() < 0.7
                else [rnd.randrange(70) for _ in range(n * BS)]
            )
            engines = self._engines(n)
            p = rnd.random()
            parent = (rnd.choice(held) if held and p < 0.6 else None) if p < 0.9 else 424242
            bs = BS
            kw: dict[str, Any] = {}
            q = rnd.random()
            if q < 0.05:
                bs = BS * 2
            elif q < 0.1:
                toks = [*toks, 7]  # a token count that is not blocks x block size
            elif q < 0.15:
                kw["lora_name"], kw["lora_id"] = "adapter", 3
            elif q < 0.2:
                kw["extra_keys"] = [("tenant",)] + [None] * (n - 1) if n else None
            elif q < 0.23:
                kw["group_idx"] = 1
            held.extend(e for e in engines)
            return enc.stored(engines, parent, toks, bs, medium=medium, **kw, **tier)
        if r < 0.55:
            engines = rnd.sample(held, min(len(held), rnd.randint(1, 4))) if held else [99]
            extra = [31337] if rnd.random() < 0.2 else []
            return enc.stored(engines + extra, None, [], 0, medium=medium, **tier)
        if r < 0.95:
            k = rnd.randint(1, 5)
            hs = [rnd.choice(held) if held and rnd.random() < 0.85 else 555 for _ in range(k)]
            return enc.removed(hs, medium=medium, group_idx=1 if rnd.random() < 0.03 else None, **tier)
        return enc.cleared()

    def payload(self, src: SourceKey) -> bytes:
        rnd = self.rnd
        events = [self.event(src) for _ in range(rnd.randint(1, 5))]
        if self.tiers and rnd.random() < 0.3:
            events.reverse()  # offload tiers announce a batch's chunks in any order: children first
        rank = src.dp_rank if rnd.random() < 0.9 else src.dp_rank + 1
        data = self.enc.batch(events, ts=float(rnd.randrange(100)), dp_rank=rank)
        r = rnd.random()
        if r < 0.08:  # one byte changed
            i = rnd.randrange(len(data))
            data = data[:i] + bytes([rnd.randrange(256)]) + data[i + 1 :]
        elif r < 0.12:  # cut short
            data = data[: rnd.randrange(len(data))]
        return data


def state(ix: Indexer, queries: list[list[int]]) -> tuple[object, ...]:
    answers = [msgspec.to_builtins(ix.lookup(q)) for q in queries]
    return (
        msgspec.to_builtins(ix.counters),
        answers,
        sorted((str(s), sorted(ix.index.blocks(s).items())) for s in ix.sources()),
        sorted((str(s), ts) for s, ts in ix.last_event_ts.items()),
        ix.index.total_entries(),
        msgspec.to_builtins(ix.lookup(queries[-1]).stores),
        None if ix.stores is None else sorted(ix.stores.drops.items()),
    )


def same_steps(rnd: random.Random, stream: Stream, fast: Indexer, ref: Indexer, steps: int) -> None:
    """``steps`` payloads of ``stream`` to both indexers: each applies as many events and ends in the same
    state after every payload."""
    queries = [[*stream.trunk[: BS * k], 1] for k in (1, 3, 6, 12)]
    for step in range(steps):
        src = rnd.choice(SOURCES)
        data = stream.payload(src)
        # the subscriber's call (the source given) or direct use (the batch's rank decides)
        kw: dict[str, Any] = {"_source": src} if rnd.random() < 0.5 else {"dp_rank": src.dp_rank}
        got = fast.apply_payload(src.instance, data, **kw)
        want = ref.apply_payload(src.instance, data, **kw)
        assert got == want, step
        assert state(fast, queries) == state(ref, queries), step


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1), st.sampled_from(RELEASES), st.integers(5, 60))
def test_fast_path_equals_reference_path(seed: int, release: str, steps: int) -> None:
    rnd = random.Random(seed)
    stream = Stream(rnd, release)
    fast, ref = make(True), make(False)
    same_steps(rnd, stream, fast, ref, steps)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1), st.sampled_from(RELEASES), st.integers(5, 60), st.booleans())
def test_fast_path_equals_reference_path_with_tier_fields(
    seed: int, release: str, steps: int, with_stores: bool
) -> None:
    """Events carrying locality / ownership, offload children before their parents, and (``with_stores``)
    shared stores that route offload events: the fast path on and off end in the same state."""
    rnd = random.Random(seed)
    stream = Stream(rnd, release, tiers=True)
    shared = STORES if with_stores else None
    fast, ref = make(True, shared), make(False, shared)
    same_steps(rnd, stream, fast, ref, steps)


def test_a_bad_event_inside_a_batch_is_counted_and_the_rest_applied() -> None:
    """An unknown parent in the middle of a batch: the events before it are applied by the fast path,
    the error counted, the events after it applied, as the reference path does."""
    enc = PayloadEncoder()
    for fast in (True, False):
        ix = make(fast)
        src = SOURCES[2]
        toks = list(range(BS * 3))
        ix.apply_payload(src.instance, enc.batch([enc.stored([1], None, toks[:BS], BS)], ts=1.0))
        payload = enc.batch(
            [
                enc.stored([2], 1, toks[BS : 2 * BS], BS),
                enc.stored([9], 77, toks[2 * BS :], BS),  # parent 77 was never stored
                enc.stored([3], 2, toks[2 * BS :], BS),
                enc.removed([2, 8]),  # 8: unknown
            ],
            ts=2.0,
        )
        assert ix.apply_payload(src.instance, payload) == 3
        c = ix.counters
        assert (c.events, c.blocks_stored, c.blocks_removed) == (5, 3, 1), fast
        assert dict(c.event_errors) == {"unknown_parent": 1, "unknown_removed_block": 1}, fast
        best = ix.lookup(np.array(toks, dtype=np.uint32)).best()
        assert best is not None and best.matched_blocks == 1  # block 2 removed: a hole after block 1


def test_payloads_larger_than_any_before_grow_the_scratch_arrays() -> None:
    """More blocks, then more events, in one payload than the scratch arrays were made for."""
    enc = PayloadEncoder()
    for fast in (True, False):
        ix = Indexer(BS, fast_ingest=fast)
        ix.apply_payload("a", enc.batch([enc.stored([1], None, [1] * BS, BS)], ts=1.0))
        n = 6000  # blocks in one event
        toks = [i % 1000 for i in range(n * BS)]
        engines = list(range(10, 10 + n))
        ix.apply_payload("a", enc.batch([enc.stored(engines, 1, toks, BS)], ts=2.0))
        assert [m.matched_blocks for m in ix.lookup([1] * BS + toks).instances] == [n + 1]
        # 300 one-hash removals (vLLM's eviction shape), from the last block back
        ix.apply_payload("a", enc.batch([enc.removed([e]) for e in engines[::-1][:300]], ts=3.0))
        assert [m.matched_blocks for m in ix.lookup([1] * BS + toks).instances] == [n + 1 - 300]
        assert (ix.counters.blocks_stored, ix.counters.blocks_removed) == (n + 1, 300)
        assert not ix.counters.event_errors
