"""The simulated engine against vLLM's rules, one literal scenario per rule."""

from __future__ import annotations

import pytest

from kvrouter.lab.sim.engine import (
    CacheConfig,
    DuplicateRequest,
    Engine,
    EngineConfig,
    RequestRejected,
    RequestTooLong,
    SchedulerConfig,
    SimConfigError,
    StepResult,
    UnknownProfile,
    get_profile,
)
from kvrouter.lab.sim.engine.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvrouter.lab.sim.engine.scheduler import BatchStats
from kvrouter.lab.sim.engine.timing import TimingModel


def make(
    *,
    bs: int = 4,
    blocks: int = 32,
    seqs: int = 8,
    budget: int = 64,
    cpu: int = 0,
    events: bool = True,
    caching: bool = True,
) -> Engine:
    return Engine(
        EngineConfig(
            cache=CacheConfig(
                block_size=bs,
                num_gpu_blocks=blocks,
                cpu_offload_blocks=cpu,
                enable_kv_cache_events=events,
                enable_prefix_caching=caching,
            ),
            scheduler=SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget),
        )
    )


def run(e: Engine) -> tuple[list[StepResult], list[list[KVEvent]]]:
    steps: list[StepResult] = []
    events: list[list[KVEvent]] = []
    while e.has_work():
        steps.append(e.step())
        events.append(e.take_events())
    return steps, events


def flat(events: list[list[KVEvent]]) -> list[KVEvent]:
    return [ev for batch in events for ev in batch]


def stored(events: list[list[KVEvent]], medium: str = "GPU") -> list[BlockStored]:
    return [ev for ev in flat(events) if isinstance(ev, BlockStored) and ev.medium == medium]


def cached_tokens(steps: list[StepResult], rid: str) -> int:
    return next(o.cached_tokens for s in steps for o in s.outputs if o.request_id == rid)


P8 = [101, 102, 103, 104, 105, 106, 107, 108]


def test_first_request_stores_full_blocks_chained_from_none() -> None:
    e = make()
    e.add_request("a", [*P8, 109], 1)  # 9 tokens: 2 full blocks, 1 partial
    steps, events = run(e)
    h = e.block_hashes(P8)
    assert stored(events) == [BlockStored(h, None, P8, 4, extra_keys=[None, None])]
    assert cached_tokens(steps, "a") == 0


def test_a_full_hit_recomputes_the_last_block_and_stores_it_again() -> None:
    e = make()
    e.add_request("a", P8, 1)
    run(e)
    e.add_request("b", P8, 1)  # every block cached, but the last token must be computed
    steps, events = run(e)
    h = e.block_hashes(P8)
    assert cached_tokens(steps, "b") == 4
    assert steps[0].prefill_tokens == 4
    # the recomputed block is cached again (vLLM never de-duplicates) and announced with its parent
    assert flat(events) == [BlockStored([h[1]], h[0], P8[4:], 4, extra_keys=[None])]
    m = e.metrics()
    assert (m.prefix_cache_queries_total, m.prefix_cache_hits_total) == (16, 4)
    assert m.gpu_cached_blocks == 3  # h0, h1 and the duplicate h1


def test_a_hit_emits_nothing() -> None:
    e = make()
    e.add_request("a", [*P8, 1, 2, 3, 4], 1)
    run(e)
    e.add_request("b", [*P8, 9], 1)
    steps, events = run(e)
    assert cached_tokens(steps, "b") == 8 and flat(events) == []


def test_chunked_prefill_emits_one_chained_event_per_step() -> None:
    e = make(budget=6)
    prompt = list(range(1, 17))
    e.add_request("a", prompt, 1)
    _, events = run(e)
    h = e.block_hashes(prompt)
    assert [len(b) for b in events] == [1, 1, 1]
    assert stored(events) == [
        BlockStored(h[0:1], None, prompt[0:4], 4, extra_keys=[None]),
        BlockStored(h[1:3], h[0], prompt[4:12], 4, extra_keys=[None, None]),
        BlockStored(h[3:4], h[2], prompt[12:16], 4, extra_keys=[None]),
    ]


def test_decode_fills_blocks_with_generated_tokens() -> None:
    e = make()
    prompt = [7, 7, 7, 7, 8, 8]
    e.add_request("a", prompt, 7)
    steps, events = run(e)
    out = [t for s in steps for o in s.outputs for t in o.new_token_ids]
    assert len(out) == 7 and steps[-1].outputs[0].finished
    everything = prompt + out
    h = e.block_hashes(everything)
    # KV exists for 6 + 7 - 1 = 12 tokens: 3 blocks; the last sampled token is never fed back
    got = stored(events)
    assert [ev.block_hashes for ev in got] == [h[0:1], h[1:2], h[2:3]]
    assert [ev.token_ids for ev in got] == [everything[0:4], everything[4:8], everything[8:12]]
    assert [ev.parent_block_hash for ev in got] == [None, h[0], h[1]]
    assert e.cached_prefix_blocks(everything) == 3


def test_outputs_are_deterministic_per_seed() -> None:
    def tokens(e: Engine, rid: str, seed: int | None) -> list[int]:
        e.add_request(rid, [1, 2, 3], 5, seed=seed)
        return [t for s in run(e)[0] for o in s.outputs for t in o.new_token_ids]

    assert tokens(make(), "x", 7) == tokens(make(), "y", 7)
    assert tokens(make(), "x", None) == tokens(make(), "x", None)
    assert tokens(make(), "x", None) != tokens(make(), "y", None)


def test_preemption_takes_the_most_recent_request_and_recomputes_it() -> None:
    e = make(bs=2, blocks=5, seqs=4)
    e.add_request("a", [1, 2, 3, 4], 6)
    e.add_request("b", [5, 6, 7, 8], 6)
    steps, _ = run(e)
    first = next(s for s in steps if s.preempted)
    assert first.preempted == ["b"]
    assert e.metrics().num_preemptions_total >= 1
    outs = {str(o.request_id): o for s in steps for o in s.outputs if o.finished}
    assert outs["a"].num_output_tokens == 6 and outs["b"].num_output_tokens == 6
    assert outs["b"].cached_tokens == 0  # set at first admission only
    assert e.metrics().kv_cache_usage_perc == 0.0


def test_no_admission_in_a_step_that_preempted() -> None:
    """A step that preempts (recompute mode) puts its victim back at the FRONT of the waiting queue and
    admits nothing: c, waiting before that step, stays queued behind the preempted b, and only a ran.
    (Step 1 runs a and b; step 2 must preempt: the 5-block pool cannot grow both.)"""
    e = make(bs=2, blocks=5, seqs=4)
    e.add_request("a", [1, 2, 3, 4], 6)
    e.add_request("b", [5, 6, 7, 8], 6)
    assert not e.step().preempted
    e.add_request("c", [9, 9], 1)
    step = e.step()
    assert step.preempted == ["b"]
    assert [str(r.request_id) for r in e.scheduler.running] == ["a"]
    assert [str(r.request_id) for r in e.scheduler.waiting] == ["b", "c"]
    assert all(o.request_id == "a" for o in step.outputs)
    # later steps admit again: every request completes
    more, _ = run(e)
    done = {str(o.request_id): o.num_output_tokens for s in more for o in s.outputs if o.finished}
    assert done == {"a": 6, "b": 6, "c": 1}


def test_abort_frees_blocks_and_keeps_them_cached() -> None:
    e = make()
    e.add_request("a", [*P8, 1], 50)
    e.step()
    assert e.metrics().kv_cache_usage_perc > 0
    assert e.abort("a") is True and e.abort("a") is False
    assert e.metrics().kv_cache_usage_perc == 0.0 and not e.has_work()
    assert e.cached_prefix_blocks(P8) == 2
    e.add_request("w", [1, 2], 3)
    assert e.abort("w") is True and not e.has_work()


def test_restart_loses_everything_silently() -> None:
    e = make()
    e.add_request("a", P8, 1)
    run(e)
    e.add_request("b", [*P8, 5], 20)
    e.step()
    assert e.restart() == ["b"]
    assert e.take_events() == [] and not e.has_work()
    assert e.cached_prefix_blocks(P8) == 0
    assert e.metrics().prefix_cache_queries_total == 0
    e.add_request("b", P8, 1)  # the id is free again
    assert cached_tokens(run(e)[0], "b") == 0


def test_reset_prefix_cache() -> None:
    e = make()
    e.add_request("a", P8, 1)
    run(e)
    e.add_request("b", [9] * 8, 30)
    e.step()
    e.take_events()
    assert e.reset_prefix_cache() is False
    assert e.take_events() == []
    assert e.reset_prefix_cache(reset_running_requests=True) is True
    assert e.take_events() == [AllBlocksCleared()]  # no removals
    assert e.cached_prefix_blocks(P8) == 0
    assert e.metrics().num_requests_waiting == 1  # b was preempted, not lost


def test_salt_and_lora_keep_caches_apart_and_are_reported() -> None:
    e = make()
    e.add_request("plain", P8, 1)
    e.add_request("salted", P8, 1, cache_salt="tenant-a")
    e.add_request("lora", P8, 1, lora_name="sql", cache_salt="tenant-a")
    steps, events = run(e)
    assert all(o.cached_tokens == 0 for s in steps for o in s.outputs)
    by_keys = {tuple(ev.extra_keys or ()): ev for ev in stored(events)}
    assert set(by_keys) == {(None, None), (("tenant-a",), None), (("sql", "tenant-a"), ("sql",))}
    lora = by_keys[(("sql", "tenant-a"), ("sql",))]
    assert (lora.lora_name, lora.lora_id) == ("sql", 1)
    hashes = [tuple(ev.block_hashes) for ev in stored(events)]
    assert len(set(hashes)) == 3
    assert e.cached_prefix_blocks(P8, cache_salt="tenant-a") == 2
    assert e.cached_prefix_blocks(P8, cache_salt="tenant-b") == 0


def test_cpu_tier_catches_gpu_evictions_and_feeds_hits_back() -> None:
    """The connector's shape (tests/kvrouter/lab/sim/engine/test_offload_golden.py holds it to vLLM's): one
    placeholder per offloaded prompt block, a load from CPU that takes a step of its own, and a prompt
    found whole on CPU loaded whole (its last token recomputed, all of it reported cached)."""
    e = make(bs=4, blocks=6, cpu=32)
    a = list(range(1, 17))  # 4 blocks
    e.add_request("a", a, 6)
    _, events = run(e)
    h = e.block_hashes(a)
    assert stored(events, "CPU") == [BlockStored([x], None, [], 4, medium="CPU") for x in h]
    assert len(stored(events)) == 2  # a decode block filled on GPU, not offloaded (prompt blocks only)
    for i in range(3):  # push a's blocks out of the 6-block GPU pool
        e.add_request(f"x{i}", [100 + i] * 16, 1)
        run(e)
    assert e.cached_prefix_blocks(a) == 0
    e.add_request("a2", a, 1)
    steps, events = run(e)
    assert (steps[0].num_scheduled, steps[0].loaded_tokens) == (0, 16)  # the load's own step
    assert stored(events[:1]) == []  # loaded blocks are cached when the request runs
    assert cached_tokens(steps, "a2") == 16 and steps[1].prefill_tokens == 1
    assert stored(events)[0] == BlockStored(h, None, a, 4, extra_keys=[None] * 4)
    assert stored(events, "CPU") == []  # already there
    m = e.metrics()
    assert (m.external_prefix_cache_hits_total, m.cpu_cached_blocks) == (16, 16)


def test_events_and_caching_switches() -> None:
    e = make(events=False)
    e.add_request("a", P8, 1)
    e.add_request("b", P8, 1)
    assert flat(run(e)[1]) == []
    e = make(caching=False)
    e.add_request("a", P8, 1)
    run(e)
    e.add_request("b", P8, 1)
    steps, events = run(e)
    assert cached_tokens(steps, "b") == 0 and flat(events) == []


def test_requests_vllm_would_refuse() -> None:
    e = make(blocks=4)  # 16 tokens fit
    with pytest.raises(RequestTooLong):
        e.add_request("a", [1] * 10, 7)
    with pytest.raises(RequestRejected):
        e.add_request("a", [], 1)
    with pytest.raises(RequestRejected):
        e.add_request("a", [1], 0)
    e.add_request("a", [1], 1)
    with pytest.raises(DuplicateRequest):
        e.add_request("a", [1], 1)


def test_config_validation() -> None:
    with pytest.raises(UnknownProfile):
        Engine(EngineConfig(profile="gpt-9"))
    with pytest.raises(SimConfigError):
        Engine(EngineConfig(cache=CacheConfig(block_size=0)))
    with pytest.raises(SimConfigError):
        Engine(
            EngineConfig(cache=CacheConfig(num_gpu_blocks=4), scheduler=SchedulerConfig(max_model_len=100))
        )
    with pytest.raises(SimConfigError):
        Engine(EngineConfig(speed=0))


def test_profiles_capacity_arithmetic() -> None:
    assert get_profile("llama-3.1-70b-8xh100").kv_capacity_blocks(16) == pytest.approx(82_870, rel=0.01)
    assert get_profile("qwen3-32b-2xh100").kv_capacity_blocks(16) == pytest.approx(18_670, rel=0.01)
    assert Engine(EngineConfig(profile="qwen3-32b-2xh100")).max_model_len == 40960


def test_timing_model() -> None:
    llama = TimingModel(get_profile("llama-3.1-70b-8xh100"))
    decode1 = llama.step_time(
        BatchStats(num_scheduled=1, decode_tokens=1, context_tokens=1000, attention_pairs=1000)
    )
    assert 0.012 < decode1 < 0.014  # ~13 ms per token at batch 1 (the calibration target)
    prefill = llama.step_time(
        BatchStats(
            num_scheduled=1, prefill_tokens=8192, context_tokens=8192, attention_pairs=8192 * 8193 // 2
        )
    )
    assert 0.3 < prefill < 0.5  # an 8k prompt alone: ~0.4 s to the first token
    # cached tokens cost nothing: the same prompt with 6k tokens cached computes only 2k
    hit = llama.step_time(
        BatchStats(
            num_scheduled=1,
            prefill_tokens=2048,
            context_tokens=8192,
            attention_pairs=2048 * 6144 + 2048 * 2049 // 2,
        )
    )
    assert hit < prefill / 2
    assert llama.step_time(BatchStats()) == 0.0
    fast = TimingModel(get_profile("llama-3.1-70b-8xh100"), speed=10)
    assert fast.step_time(BatchStats(num_scheduled=1, decode_tokens=1, context_tokens=1000)) == pytest.approx(
        llama.step_time(BatchStats(num_scheduled=1, decode_tokens=1, context_tokens=1000)) / 10
    )
    qwen = TimingModel(get_profile("qwen3-32b-2xh100"))
    assert 0.016 < qwen.step_time(BatchStats(num_scheduled=1, decode_tokens=1, context_tokens=1000)) < 0.019
    # decode batches are memory-bound until the batch is large: 64 sequences cost far less than 64x one
    big = llama.step_time(BatchStats(num_scheduled=64, decode_tokens=64, context_tokens=64 * 2000))
    assert big < 3 * decode1


def test_engine_durations_come_from_the_profile() -> None:
    e = make()
    e.add_request("a", P8, 3)
    steps, _ = run(e)
    assert all(s.duration_s > 0 for s in steps)
    fast = Engine(
        EngineConfig(speed=4, cache=CacheConfig(block_size=4, num_gpu_blocks=32), scheduler=SchedulerConfig())
    )
    fast.add_request("a", P8, 3)
    assert [s.duration_s * 4 for s in run(fast)[0]] == pytest.approx([s.duration_s for s in steps])
    idle = make()
    assert idle.step().duration_s == 0.0 and idle.take_events() == []


def test_metrics_snapshot() -> None:
    e = make(seqs=1)
    e.add_request("a", P8, 2)
    e.add_request("b", P8, 2)
    e.step()
    m = e.metrics()
    assert (m.num_requests_running, m.num_requests_waiting) == (1, 1)
    assert m.kv_cache_usage_perc == pytest.approx(2 / 32)
    run(e)
    m = e.metrics()
    assert (m.request_success_total, m.generation_tokens_total, m.prompt_tokens_total) == (2, 4, 16)


def test_eviction_takes_a_freed_prompts_tail_first_one_removal_per_block() -> None:
    """A full pool evicts to admit: vLLM frees a request's blocks tail first, so its last block goes before
    its first (the shared prefix survives longest); each evicted block is one ``BlockRemoved``, emitted
    before the stores of the step that needed the room."""
    e = make(blocks=4)
    e.add_request("a", P8, 1)
    run(e)
    h = e.block_hashes(P8)
    e.add_request("b", list(range(1, 13)), 1)  # 12 prompt tokens + 1: all 4 blocks
    _, events = run(e)
    got = flat(events)
    assert got[0] == BlockRemoved([h[1]])
    assert isinstance(got[1], BlockStored) and len(got) == 2
    assert e.cached_prefix_blocks(P8) == 1


def test_given_output_tokens_are_generated_in_order() -> None:
    e = make()
    e.add_request("a", [1, 2, 3], 5, output_token_ids=[40, 41])
    out = [t for s in run(e)[0] for o in s.outputs for t in o.new_token_ids]
    assert out[:2] == [40, 41] and len(out) == 5
    e.add_request("b", [1, 2, 3], 2, output_token_ids=[7, 8, 9])
    assert [t for s in run(e)[0] for o in s.outputs for t in o.new_token_ids] == [7, 8]


@pytest.mark.parametrize("profile", ["llama-3.1-70b-8xh100", "qwen3-32b-2xh100"])
@pytest.mark.parametrize(("batch", "base", "k"), [(1, 10, 1), (7, 5000, 13), (200, 1_600_000, 300)])
def test_decode_run_time_is_the_sum_of_its_steps(profile: str, batch: int, base: int, k: int) -> None:
    """The coalesced decode phases' duration is the per-step model summed, to the last bit."""
    for speed in (1.0, 8.0):
        tm = TimingModel(get_profile(profile), speed=speed)
        steps = [
            BatchStats(
                num_scheduled=batch,
                decode_tokens=batch,
                attention_pairs=base + j * batch,
                context_tokens=base + j * batch,
            )
            for j in range(k)
        ]
        assert tm.decode_run_time(batch, base, k) == sum(tm.step_time(s) for s in steps)
