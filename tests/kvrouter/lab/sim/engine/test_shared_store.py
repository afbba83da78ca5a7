"""The shared store (L2) of the simulated engines: its LRU against a list-based reference, and two engines
attached to it as vLLM's offloading announces it (placeholders from the writer, never a removal)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouter.lab.sim.engine import CacheConfig, Engine, EngineConfig, SchedulerConfig, StepResult
from kvrouter.lab.sim.engine.events import BlockRemoved, BlockStored, KVEvent
from kvrouter.lab.sim.engine.scheduler import BatchStats
from kvrouter.lab.sim.engine.shared_store import SharedStore
from kvrouter.lab.sim.engine.types import BlockHash

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.lists(st.integers(0, 12), max_size=6)),
        st.tuples(st.just("lookup"), st.lists(st.integers(0, 12), max_size=6)),
    ),
    max_size=40,
)


@settings(max_examples=120, deadline=None)
@given(st.integers(1, 8), OPS)
def test_store_is_an_lru_with_a_capacity(cap: int, ops: list[tuple[str, list[int]]]) -> None:
    store = SharedStore(cap, 4, 1e9)
    ref: list[int] = []  # least recently used first
    for op, hs in ops:
        hashes = [BlockHash(h) for h in hs]
        if op == "put":
            new = list(dict.fromkeys(h for h in hashes if h not in ref))
            want = new if new and len(new) <= cap else []
            ref = (ref + want)[-cap:] if want else ref
            assert store.put(hashes) == want
        else:
            n = 0
            while n < len(hashes) and hashes[n] in ref:
                n += 1
            for h in reversed(hashes[:n]):
                ref.remove(h)
                ref.append(h)
            assert store.lookup(hashes, 0, len(hashes)) == n
        assert len(store) == len(ref) <= cap and all(h in store for h in ref)


def _engine(store: SharedStore, *, cpu: int = 0) -> Engine:
    return Engine(
        EngineConfig(
            cache=CacheConfig(block_size=4, num_gpu_blocks=8, cpu_offload_blocks=cpu),
            scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
        ),
        shared=store,
    )


def _run(e: Engine) -> tuple[list[StepResult], list[KVEvent]]:
    steps: list[StepResult] = []
    events: list[KVEvent] = []
    while e.has_work():
        steps.append(e.step())
        events += e.take_events()
    return steps, events


A = list(range(1, 17))  # four blocks of 4


def test_an_instance_loads_what_another_wrote() -> None:
    store = SharedStore(64, 4, 10e9)
    a, b = _engine(store), _engine(store)
    a.add_request("a", A, 1)
    _, ev_a = _run(a)
    h = a.block_hashes(A)
    # the writer announces its write as a placeholder on its own stream
    assert [e for e in ev_a if isinstance(e, BlockStored) and e.medium == "STORAGE"] == [
        BlockStored(h, None, [], 4, medium="STORAGE")
    ]
    b.add_request("b", A, 1)
    steps, ev_b = _run(b)
    out = next(o for s in steps for o in s.outputs if o.request_id == "b")
    # three blocks from the store (the last prompt token is always computed), none on b's GPU before
    assert (out.cached_tokens, out.shared_loaded_tokens, out.cpu_loaded_tokens) == (12, 12, 0)
    assert steps[0].shared_loaded_tokens == 12 and steps[0].prefill_tokens == 4
    # b writes nothing the store holds already: no placeholder for the blocks a wrote
    written = [e for e in ev_b if isinstance(e, BlockStored) and e.medium == "STORAGE"]
    assert all(not set(e.block_hashes) & set(h) for e in written)


def test_cpu_first_then_the_store() -> None:
    store = SharedStore(64, 4, 10e9)
    a, b = _engine(store), _engine(store, cpu=16)
    a.add_request("a", A, 1)
    _run(a)
    b.add_request("b0", A[:8], 1)  # b computes the first two blocks (GPU, CPU)
    _run(b)
    for i in range(3):  # and loses them from its 8-block GPU pool
        b.add_request(f"x{i}", [500 + i] * 16, 1)
        _run(b)
    assert b.cached_prefix_blocks(A) == 0
    b.add_request("b", A, 1)
    steps, _ = _run(b)
    out = next(o for s in steps for o in s.outputs if o.request_id == "b")
    assert (out.cpu_loaded_tokens, out.shared_loaded_tokens, out.cached_tokens) == (8, 4, 12)


def test_evictions_are_silent_and_a_restart_keeps_the_store() -> None:
    store = SharedStore(4, 4, 10e9)
    a = _engine(store)
    events: list[KVEvent] = []
    for i in range(4):
        a.add_request(f"r{i}", [100 * i + k for k in range(16)], 1)
        events += _run(a)[1]
    assert store.evicted > 0 and len(store) == 4
    assert not [e for e in events if isinstance(e, BlockRemoved) and e.medium != "GPU"]
    kept = len(store)
    a.restart()
    assert len(store) == kept


def test_loads_cost_the_store_bandwidth() -> None:
    fast, slow = _engine(SharedStore(8, 4, 100e9)), _engine(SharedStore(8, 4, 1e9))
    stats = BatchStats(num_scheduled=1, prefill_tokens=4, shared_loaded_tokens=1000)
    kvb = fast.profile.kv_bytes_per_token
    gap = slow.timing.step_time(stats) - fast.timing.step_time(stats)
    assert abs(gap - 1000 * kvb * (1 / 1e9 - 1 / 100e9)) < 1e-12
