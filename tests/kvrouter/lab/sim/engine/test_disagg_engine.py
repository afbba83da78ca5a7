"""The engine in a disaggregated fleet: a prefill leg holds its blocks, a decode leg pulls its prompt and
announces the received blocks, as vLLM 0.33's NIXL connector (pull mode) and scheduler do."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouter.lab.sim.engine import CacheConfig, Engine, EngineConfig, SchedulerConfig
from kvrouter.lab.sim.engine.events import BlockRemoved, BlockStored, KVEvent
from kvrouter.lab.sim.engine.scheduler import KvLoad

BS = 4


def make(blocks: int = 64, budget: int = 64) -> Engine:
    return Engine(
        EngineConfig(
            cache=CacheConfig(block_size=BS, num_gpu_blocks=blocks),
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget),
        )
    )


def drain(e: Engine) -> list[KVEvent]:
    out: list[KVEvent] = []
    while e.has_work():
        e.step()
        out += e.take_events()
    return out


def stored(events: list[KVEvent]) -> list[int]:
    return [h for ev in events if isinstance(ev, BlockStored) for h in ev.block_hashes]


def test_a_prefill_leg_holds_its_blocks_until_released() -> None:
    e = make(blocks=16)
    prompt = list(range(1, 23))  # 5 full blocks + 2 tokens: 6 blocks
    e.add_request("p", prompt, 1, hold_blocks=True)
    events = drain(e)
    assert len(stored(events)) == 5
    held = e.held("p")
    assert held is not None and len(held[0]) == 6 and held[1] == 22
    assert e.pool.num_free == 16 - 6 and e.num_held == 1  # still allocated: nothing can evict them
    assert e.release_held("p") and not e.release_held("p")
    assert e.held("p") is None and e.pool.num_free == 16
    # released blocks stay cached (evictable): the same prompt hits them
    e.add_request("again", prompt, 1)
    e.step()
    assert e.scheduler.counters.prefix_cache_hits == 20


def test_a_decode_leg_pulls_its_prompt_announces_it_and_computes_only_the_last_token() -> None:
    d = make()
    prompt = list(range(100, 118))  # 4 full blocks + 2
    d.add_request("r", prompt, 3, remote_prefill_tokens=len(prompt))
    first = d.step()
    assert first.outputs == [] and first.prefill_tokens == 0
    assert d.take_loads() == [KvLoad("r", 0, 18)]
    assert not d.has_work() and d.num_loading == 1
    assert d.take_events() == []  # nothing announced before it lands
    assert d.finish_load("r", ok=True) and not d.finish_load("r", ok=True)
    landed = d.take_events()
    assert stored(landed) == d.block_hashes(prompt)
    assert isinstance(landed[0], BlockStored) and landed[0].token_ids == prompt[:16]
    step = d.step()
    assert step.prefill_tokens == 1 and step.outputs[0].first_token
    assert step.outputs[0].cached_tokens == 18
    assert d.take_events() == []  # the last block is not full: nothing more to announce
    drain(d)
    assert d.cached_prefix_blocks(prompt) == 4


def test_a_local_hit_is_kept_and_only_the_rest_pulled() -> None:
    d = make()
    shared = list(range(1, 13))  # 3 full blocks
    d.add_request("warm", [*shared, 50, 51, 52], 1)
    drain(d)
    prompt = [*shared, 7, 7, 7, 7, 7, 7, 7, 7, 9]
    d.add_request("r", prompt, 2, remote_prefill_tokens=len(prompt))
    d.step()
    assert d.take_loads() == [KvLoad("r", 12, len(prompt) - 12)]
    d.finish_load("r", ok=True)
    ev = d.take_events()
    hashes = d.block_hashes(prompt)
    assert stored(ev) == hashes[3:5]
    assert isinstance(ev[0], BlockStored) and ev[0].parent_block_hash == hashes[2]


def test_a_prompt_cached_here_pulls_only_its_tail() -> None:
    d = make()
    prompt = list(range(1, 18))
    d.add_request("warm", prompt, 1)
    drain(d)
    # vLLM's local hit stops short of the last token, so the tail is still pulled
    d.add_request("r", prompt, 2, remote_prefill_tokens=len(prompt))
    d.step()
    assert d.take_loads() == [KvLoad("r", 16, 1)]


def test_nothing_left_to_pull_runs_at_once_and_still_releases_the_prefill() -> None:
    d = make()
    prompt = list(range(1, 18))
    d.add_request("warm", prompt, 1)
    drain(d)
    d.add_request("r", prompt, 2, remote_prefill_tokens=12)  # the prefill instance holds less than D has
    step = d.step()
    assert d.take_loads() == [KvLoad("r", 16, 0)]  # the shell still tells the prefill instance to free
    assert step.prefill_tokens == 1 and d.num_loading == 0


def test_a_failed_transfer_is_computed_locally() -> None:
    d = make()
    prompt = list(range(1, 18))
    d.add_request("r", prompt, 2, remote_prefill_tokens=len(prompt))
    d.step()
    d.take_loads()
    assert d.finish_load("r", ok=False)
    assert d.take_events() == []  # nothing landed, nothing announced
    step = d.step()
    assert step.prefill_tokens == 17
    assert stored(d.take_events()) == d.block_hashes(prompt)


def test_an_aborted_transfer_frees_its_blocks() -> None:
    d = make(blocks=16)
    d.add_request("r", list(range(1, 30)), 2, remote_prefill_tokens=29)
    d.step()
    assert d.pool.num_free == 16 - 8
    assert d.abort("r") and d.pool.num_free == 16
    assert not d.finish_load("r", ok=True)


def test_a_transfer_does_not_take_a_batch_slot_or_stall_other_requests() -> None:
    d = make(budget=8)
    d.add_request("pd", list(range(1, 40)), 2, remote_prefill_tokens=39)
    d.add_request("local", list(range(200, 206)), 2)
    step = d.step()
    assert step.prefill_tokens == 6 and [o.request_id for o in step.outputs] == ["local"]


def test_a_released_hold_may_be_evicted_and_says_so() -> None:
    e = make(blocks=6)
    e.add_request("p", list(range(1, 9)), 1, hold_blocks=True)
    drain(e)
    e.add_request("q", list(range(50, 70)), 1)
    e.step()
    assert e.scheduler.waiting  # q needs 5 blocks; 4 are free while p holds 2
    e.release_held("p")
    events = drain(e)
    assert any(isinstance(ev, BlockRemoved) for ev in events)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(min_value=1, max_value=60),
    local_blocks=st.integers(min_value=0, max_value=15),
)
def test_decode_leg_caches_what_an_aggregated_engine_would(n: int, local_blocks: int) -> None:
    """Reference model: an engine that computes the prompt itself caches its full blocks; a decode
    leg ends with the same cache, announcing exactly the blocks its local hit lacked."""
    prompt = [(i * 7919) % 5000 + 1 for i in range(n)]
    local_blocks = min(local_blocks, (n - 1) // BS)
    ref = make()
    ref.add_request("r", prompt, 1)
    drain(ref)
    d = make()
    if local_blocks:
        d.add_request("warm", [*prompt[: local_blocks * BS], 9999], 1)
        drain(d)
    d.add_request("r", prompt, 1, remote_prefill_tokens=n)
    events = []
    while d.has_work() or d.num_loading:
        d.step()
        events += d.take_events()
        for load in d.take_loads():
            assert load.local_tokens == local_blocks * BS
            assert load.tokens == n - local_blocks * BS
            d.finish_load(load.request_id, ok=True)
            events += d.take_events()
    hashes = d.block_hashes(prompt)
    assert stored(events) == hashes[local_blocks : n // BS]
    assert d.pool.cached_hashes() >= set(hashes) and ref.pool.cached_hashes() >= set(hashes)
    d.pool.check()
