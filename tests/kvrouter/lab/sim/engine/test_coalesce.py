"""``Engine.step_many`` (the evaluator's fast path through decode phases) equals stepping one by one."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouter.lab.sim.engine.engine import CacheConfig, Engine, EngineConfig
from kvrouter.lab.sim.engine.events import BlockRemoved, BlockStored
from kvrouter.lab.sim.engine.scheduler import SchedulerConfig


def make(capacity: int) -> Engine:
    return Engine(
        EngineConfig(
            profile="test",
            cache=CacheConfig(block_size=4, num_gpu_blocks=capacity),
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
        )
    )


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), capacity=st.integers(24, 120), k=st.integers(2, 40))
def test_step_many_matches_single_steps(seed: int, capacity: int, k: int) -> None:
    rng = random.Random(seed)
    base = [rng.randrange(50) for _ in range(12)]
    reqs = []
    for i in range(rng.randint(1, 6)):
        prompt = base[: rng.randint(0, 12)] + [rng.randrange(50) for _ in range(rng.randint(1, 10))]
        reqs.append((f"r{i}", prompt, rng.randint(1, 30)))
    a, b = make(capacity), make(capacity)
    for e in (a, b):
        for rid, prompt, n in reqs:
            e.add_request(rid, prompt, n, seed=7)
    out_a: dict[str, list[int]] = {}
    out_b: dict[str, list[int]] = {}
    ev_a: Counter[tuple[str, int]] = Counter()
    ev_b: Counter[tuple[str, int]] = Counter()
    t_a = t_b = 0.0

    def take(e: Engine, ev: Counter[tuple[str, int]]) -> None:
        for x in e.take_events():
            if isinstance(x, BlockStored):
                ev.update(("s", h) for h in x.block_hashes)
            elif isinstance(x, BlockRemoved):
                ev.update(("r", h) for h in x.block_hashes)

    while a.has_work():
        r = a.step()
        t_a += r.duration_s
        for o in r.outputs:
            out_a.setdefault(o.request_id, []).extend(o.new_token_ids)
        take(a, ev_a)
    while b.has_work():
        r = b.step_many(k, float("inf"))
        t_b += r.duration_s
        for o in r.outputs:
            out_b.setdefault(o.request_id, []).extend(o.new_token_ids)
        take(b, ev_b)
    assert out_a == out_b
    assert ev_a == ev_b
    assert abs(t_a - t_b) < 1e-9 * max(1.0, t_a)
    assert a.pool.cached_hashes() == b.pool.cached_hashes()
    assert a.metrics().generation_tokens_total == b.metrics().generation_tokens_total
