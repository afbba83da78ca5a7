"""Differential tests: the engine against a clean-room block model, and against the indexer.

The reference is a plain list-and-dict model of vLLM's rules written from the rules, not from the pool:
a request takes its longest run of cached leading prompt blocks (at most ``(len - 1) // bs``), allocates
the rest from the head of a free list (evicting whatever hash a block had), caches every full block it
computed, and frees tail first with fresh blocks to the front.  With one request running at a time (any
chunk size), the engine must report the same cached tokens, evict the same hashes in the same order, and
store the same hashes in the same order.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from indexer import Indexer
from indexer.encode import version_tuple
from kvrouter.lab.sim.engine import CacheConfig, Engine, EngineConfig, SchedulerConfig
from kvrouter.lab.sim.engine.events import BlockRemoved, BlockStored
from kvrouter.lab.sim.engine.payload import PayloadWriter


class RefPool:
    """The reference block model: a free list, a block -> hash table, a hash -> blocks dict."""

    def __init__(self, capacity: int, bs: int) -> None:
        self.bs = bs
        self.free: list[int] = list(range(capacity))  # head is reused first
        self.hash: dict[int, int] = {}
        self.blocks_of: dict[int, list[int]] = {}  # hash -> blocks, oldest first
        self.removed: list[int] = []
        self.stored: list[int] = []

    def run(
        self, prompt_hashes: Sequence[int], all_hashes: Sequence[int], prompt_len: int, kv_tokens: int
    ) -> int:
        bs = self.bs
        hits: list[int] = []
        for h in prompt_hashes[: (prompt_len - 1) // bs]:
            if h not in self.blocks_of:
                break
            hits.append(self.blocks_of[h][0])
        for b in hits:
            if b in self.free:
                self.free.remove(b)
        new: list[int] = []
        for _ in range(-(-kv_tokens // bs) - len(hits)):
            b = self.free.pop(0)
            if b in self.hash:
                h = self.hash.pop(b)
                self.blocks_of[h].remove(b)
                if not self.blocks_of[h]:
                    del self.blocks_of[h]
                self.removed.append(h)
            new.append(b)
        table = hits + new
        for i in range(len(hits), kv_tokens // bs):
            self.hash[table[i]] = all_hashes[i]
            self.blocks_of.setdefault(all_hashes[i], []).append(table[i])
            self.stored.append(all_hashes[i])
        # One request at a time: every block of the table is freed, tail first; fresh ones go to the front.
        fresh = [b for b in reversed(table) if b not in self.hash]
        cached = [b for b in reversed(table) if b in self.hash]
        self.free = fresh + self.free + cached
        return len(hits) * bs


def prompts(draw: Callable[..., Any], n: int) -> list[tuple[list[int], int, str | None]]:
    bases = [draw(st.lists(st.integers(0, 5), min_size=1, max_size=40)) for _ in range(3)]
    out = []
    for _ in range(n):
        base = draw(st.sampled_from(bases))
        cut = draw(st.integers(0, len(base)))
        tail = draw(st.lists(st.integers(0, 5), max_size=8))
        prompt = base[:cut] + tail or [1]
        space = draw(st.sampled_from([None, None, "s1", "lora", "lora+s1"]))
        out.append((prompt, draw(st.integers(1, 12)), space))
    return out


@st.composite
def sequential_workloads(draw: Callable[..., Any]) -> dict[str, Any]:
    bs = draw(st.sampled_from([1, 2, 3, 4, 8]))
    reqs = prompts(draw, draw(st.integers(1, 25)))
    longest = max(len(p) + m for p, m, _ in reqs)  # vLLM: prompt + max_tokens <= max_model_len <= KV
    capacity = draw(st.integers(-(-longest // bs), -(-longest // bs) * 3 + 2))
    budget = draw(st.integers(1, 24))
    return {"bs": bs, "reqs": reqs, "capacity": capacity, "budget": budget}


def ns(name: str | None) -> dict[str, Any]:
    """Cache namespaces: None, a salt, a LoRA adapter, or both."""
    return {
        None: {},
        "s1": {"cache_salt": "s1"},
        "lora": {"lora_name": "sql"},
        "lora+s1": {"lora_name": "sql", "cache_salt": "s1"},
    }[name]


def make(bs: int, capacity: int, budget: int, seqs: int, cpu: int = 0) -> Engine:
    return Engine(
        EngineConfig(
            cache=CacheConfig(block_size=bs, num_gpu_blocks=capacity, cpu_offload_blocks=cpu),
            scheduler=SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget),
        )
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sequential_workloads())
def test_cached_tokens_evictions_and_stores_match_the_reference(w: dict[str, Any]) -> None:
    bs = w["bs"]
    e = make(bs, w["capacity"], w["budget"], seqs=1)
    ref = RefPool(w["capacity"], bs)
    removed: list[int] = []
    stored: list[int] = []
    for i, (prompt, max_tokens, space) in enumerate(w["reqs"]):
        e.add_request(str(i), prompt, max_tokens, **ns(space))
        out: list[int] = []
        mine: list[BlockStored] = []
        cached = -1
        while e.has_work():
            step = e.step()
            batch = e.take_events()
            assert sum(isinstance(ev, BlockStored) for ev in batch) <= 1  # one per request per step
            for ev in batch:
                if isinstance(ev, BlockRemoved):
                    assert len(ev.block_hashes) == 1  # one hash per removal event
                    removed.extend(ev.block_hashes)
                elif isinstance(ev, BlockStored):
                    mine.append(ev)
                    stored.extend(ev.block_hashes)
            e.pool.check()
            for o in step.outputs:
                out.extend(o.new_token_ids)
                cached = o.cached_tokens
        all_tokens = prompt + out
        kv_tokens = len(all_tokens) - 1  # the last sampled token is never fed back
        all_hashes = e.block_hashes(all_tokens[:kv_tokens], **ns(space))
        check_chain(mine, all_hashes, all_tokens, bs)
        want = ref.run(e.block_hashes(prompt, **ns(space)), all_hashes, len(prompt), kv_tokens)
        assert cached == want, f"request {i}"
        assert removed == ref.removed, f"evictions after request {i}"
        assert stored == ref.stored, f"stores after request {i}"
    assert e.pool.free_order() == ref.free


def check_chain(events: list[BlockStored], hashes: Sequence[int], tokens: list[int], bs: int) -> None:
    """Each store names consecutive blocks of the request, with exactly their tokens, chained to the block
    before (None only for block 0)."""
    for ev in events:
        k = hashes.index(ev.block_hashes[0])
        n = len(ev.block_hashes)
        assert ev.block_hashes == hashes[k : k + n]
        assert ev.token_ids == tokens[k * bs : (k + n) * bs]
        assert ev.parent_block_hash == (hashes[k - 1] if k else None)


@st.composite
def concurrent_workloads(draw: Callable[..., Any]) -> dict[str, Any]:
    bs = draw(st.sampled_from([2, 4]))
    reqs = prompts(draw, draw(st.integers(1, 30)))
    longest = max(len(p) + m for p, m, _ in reqs)  # vLLM: prompt + max_tokens <= max_model_len <= KV
    capacity = draw(st.integers(-(-longest // bs), -(-longest // bs) * 5 // 2))
    plan = draw(st.lists(st.sampled_from(["add", "add", "step", "step", "step", "abort"]), max_size=120))
    return {
        "bs": bs,
        "reqs": reqs,
        "capacity": capacity,
        "budget": draw(st.integers(1, 32)),
        "seqs": draw(st.integers(1, 6)),
        "cpu": draw(st.sampled_from([0, 16, 64])),
        "plan": plan,
        "release": draw(st.sampled_from(["0.33.0", "0.23.0", "0.9.0"])),
    }


# Found by this test: a request preempted while two others waited with their CPU loads landed went
# ahead of them and could never fit; they held the blocks it needed (vLLM schedules those first).
HOLDING_FIRST = {
    "bs": 2,
    "reqs": [
        *(([0] * n, m, None) for n, m in ((6, 12), (1, 5), (1, 2), (8, 9))),
        ([0, 3, *[0] * 12], 1, None),
        *(([0] * n, m, None) for n, m in ((2, 2), (8, 6), (3, 6))),
        ([0, 2, *[0] * 6], 9, None),
        ([*[0] * 7, 3], 12, None),
        ([0, 3, *[0] * 10], 1, None),
        ([0], 12, None),
        ([0] * 5, 2, None),
        ([4, 0, 0], 8, None),
    ],
    "capacity": 13,
    "budget": 25,
    "seqs": 4,
    "cpu": 64,
    "plan": ["step", "add", "step", "add", "abort"],
    "release": "0.9.0",
}


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(concurrent_workloads())
@example(HOLDING_FIRST)
def test_the_indexer_fed_by_the_engine_agrees_with_its_cache(w: dict[str, Any]) -> None:
    """Concurrent batches, preemption, aborts, the CPU tier, any release's wire shape: after every step the
    index built from the engine's own events reports exactly the prefix the engine would serve."""
    bs = w["bs"]
    e = make(bs, w["capacity"], w["budget"], w["seqs"], w["cpu"])
    ix = Indexer(block_size=bs)
    writer = PayloadWriter(w["release"])
    reqs = list(w["reqs"])
    if version_tuple(w["release"]) < (0, 20, 0):
        # Before 0.20 events carry no extra_keys (and before 0.16 no lora_name): a router cannot tell a
        # salted or adapter block from a plain one.
        reqs = [(p, m, None) for p, m, _ in reqs]
    seen: list[tuple[list[int], str | None]] = []
    live: list[str] = []
    done: dict[str, list[int]] = {}
    n = 0
    tail = ["add", "step", "step"] * len(reqs) + ["step"] * 400  # then everything runs to completion
    for op in [*w["plan"], *tail]:
        if op == "add" and n < len(reqs):
            prompt, max_tokens, space = reqs[n]
            e.add_request(str(n), prompt, max_tokens, **ns(space))
            seen.append((prompt, space))
            live.append(str(n))
            done[str(n)] = list(prompt)
            n += 1
        elif op == "abort" and live:
            e.abort(live.pop(0))
        elif op == "step":
            if not e.has_work():
                if n == len(reqs):
                    break
                continue
            step = e.step()
            for o in step.outputs:
                done[o.request_id].extend(o.new_token_ids)
                if o.finished:
                    live.remove(o.request_id)
                # vLLM recomputes the last prompt token, and reports it cached only when loaded from CPU
                whole = 0 if w["cpu"] else 1
                assert 0 <= o.cached_tokens <= o.num_prompt_tokens - whole and o.cached_tokens % bs == 0
            events = e.take_events()
            if events:
                assert ix.apply_payload("sim", writer.payload(events, 1.0)) == len(events)
            e.pool.check()
            check_agreement(e, ix, seen, done, bs)
    assert not e.has_work()
    assert ix.counters.event_errors == {}
    assert ix.counters.decode_errors == {}
    m = e.metrics()
    event(f"preempted: {m.num_preemptions_total > 0}")
    event(f"evicted: {ix.counters.blocks_removed > 0}")
    event(f"cpu hits: {m.external_prefix_cache_hits_total > 0}")


def check_agreement(
    e: Engine, ix: Indexer, seen: list[tuple[list[int], str | None]], done: dict[str, list[int]], bs: int
) -> None:
    cpu = e.kv.offload
    for tokens, space in [*seen, *((t, None) for t in done.values())]:
        hashes = e.block_hashes(tokens, **ns(space))
        want = 0
        for h in hashes:
            if not (e.pool.is_cached(h) or (cpu is not None and h in cpu)):
                break
            want += 1
        got = ix.lookup(tokens, **ns(space)).instances
        matched = got[0].matched_blocks if got else 0
        assert matched == want, (tokens, space, matched, want)
        if cpu is None:
            assert matched == e.cached_prefix_blocks(tokens, **ns(space))


def test_the_indexer_agrees_under_load() -> None:
    """A seeded heavier run (hundreds of requests sharing prefixes, a tight GPU pool, a CPU tier) that is
    sure to preempt, evict and hit the CPU tier; the index agrees after every step."""
    rng = random.Random(7)
    bs = 4
    e = make(bs, capacity=40, budget=24, seqs=6, cpu=48)
    ix = Indexer(block_size=bs)
    writer = PayloadWriter("0.33.0")
    bases = [[rng.randrange(50) for _ in range(60)] for _ in range(4)]
    seen: list[tuple[list[int], str | None]] = []
    done: dict[str, list[int]] = {}
    for i in range(250):
        base = rng.choice(bases)
        prompt = base[: rng.randrange(4, 60)] + [rng.randrange(50) for _ in range(rng.randrange(6))]
        space = rng.choice([None, None, None, "s1", "lora"])
        e.add_request(str(i), prompt, rng.randrange(1, 30), **ns(space))
        seen.append((prompt, space))
        done[str(i)] = list(prompt)
        for _ in range(rng.randrange(4)):
            step = e.step()
            for o in step.outputs:
                done[o.request_id].extend(o.new_token_ids)
            events = e.take_events()
            if events:
                ix.apply_payload("sim", writer.payload(events, 1.0))
            check_agreement(e, ix, seen[-20:], {}, bs)
    while e.has_work():
        e.step()
        if events := e.take_events():
            ix.apply_payload("sim", writer.payload(events, 1.0))
    check_agreement(e, ix, seen, done, bs)
    m = e.metrics()
    assert m.num_preemptions_total > 0 and m.external_prefix_cache_hits_total > 0
    assert ix.counters.blocks_removed > 0 and not ix.counters.event_errors
