"""The simulated encoder: which items a step encodes (vLLM's ``_try_schedule_encoder_inputs``: the window
overlaps the item, its output is not in the encoder cache) and what it costs."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrouter.lab.sim.engine import CacheConfig, Engine, EngineConfig, SchedulerConfig
from kvrouter.lab.sim.engine.encoder import EncoderCache, EncoderWindow
from kvrouter.lab.sim.engine.scheduler import BatchStats
from kvrouter.lab.sim.engine.timing import TimingModel, get_profile


class _RefCache:
    """The encoder cache as a list, newest last: evict from the front while over capacity."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.items: list[tuple[str, int]] = []

    def lookup(self, ident: str, length: int) -> bool:
        for i, (k, _) in enumerate(self.items):
            if k == ident:
                self.items.append(self.items.pop(i))
                return True
        if length <= self.capacity:
            self.items.append((ident, length))
            while sum(n for _, n in self.items) > self.capacity:
                self.items.pop(0)
        return False


@given(st.integers(0, 40), st.lists(st.tuples(st.sampled_from("abcdefg"), st.integers(1, 15)), max_size=60))
def test_encoder_cache_against_a_list(capacity: int, ops: list[tuple[str, int]]) -> None:
    cache, ref = EncoderCache(capacity), _RefCache(capacity)
    sizes: dict[str, int] = {}
    for ident, length in ops:
        length = sizes.setdefault(ident, length)  # an identifier names one item: one size
        assert cache.lookup(ident, length) == ref.lookup(ident, length)
    assert list(cache._items.items()) == ref.items
    assert cache.hits + cache.misses == len(ops)


@given(
    st.lists(st.tuples(st.integers(0, 60), st.integers(1, 20)), max_size=5),
    st.lists(st.integers(1, 30), min_size=1, max_size=12),
    st.integers(0, 80),
)
def test_each_item_the_window_reaches_is_encoded_once_unless_computed_before(
    spans: list[tuple[int, int]], chunks: list[int], start: int
) -> None:
    """A prefill from ``start`` (the prefix hit) in chunks: every item ending after ``start`` and beginning
    before the last chunk's end is encoded exactly once; items inside the hit never."""
    items = [(f"i{n}", off, length) for n, (off, length) in enumerate(spans)]
    window, cache = EncoderWindow(items), EncoderCache(0)  # no sharing: count every encode
    at, encoded = start, 0
    for n in chunks:
        encoded += window.encode(at, at + n, cache)
        at += n
    want = sum(length for _, off, length in items if off + length > start and off < at)
    assert encoded == want


def _engine(profile: str = "qwen2.5-vl-72b-8xh100") -> Engine:
    return Engine(
        EngineConfig(
            profile=profile,
            cache=CacheConfig(block_size=16, num_gpu_blocks=512),
            scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=2048, max_model_len=4096),
        )
    )


def _prefill(e: Engine, rid: str, ids: list[int], items: list[tuple[str, int, int]]) -> tuple[int, float]:
    e.add_request(rid, ids, 1, mm_items=items)
    encoded, took = 0, 0.0
    while e.has_work():
        r = e.step()
        encoded += r.encoder_tokens
        took += r.duration_s
    return encoded, took


def test_a_miss_pays_the_encoder_a_prefix_hit_or_the_encoder_cache_does_not() -> None:
    ids = list(range(100, 164)) + [7] * 300 + list(range(500, 540))  # text, an image's pads, text
    image = [("img-a", 64, 300)]
    e = _engine()
    first, t_first = _prefill(e, "a", ids, image)
    assert first == 300
    # the same prompt again: the image lies inside the prefix hit, no encoder
    again, t_again = _prefill(e, "b", ids, image)
    assert again == 0 and t_again < t_first
    # other text before the same image: the prefix stops before it, the encoder cache has it
    cached_encode, _ = _prefill(e, "d", list(range(1000, 1064)) + ids[64:], image)
    assert cached_encode == 0
    assert e.scheduler.encoder_cache.hits == 1
    # another image at the same place: same tokens, new identifier, encoded
    assert _prefill(e, "e", ids, [("img-b", 64, 300)])[0] == 300


def test_the_encoder_time_is_its_flops_at_prefill_rate() -> None:
    p = get_profile("qwen2.5-vl-72b-8xh100")
    m = TimingModel(p)
    base = BatchStats(num_scheduled=1, prefill_tokens=364, context_tokens=364, attention_pairs=364 * 365 // 2)
    with_encoder = msgspec.structs.replace(base, encoder_tokens=300)
    flops = p.num_gpus * p.peak_flops * p.mfu
    want = 300 * p.encoder_flops_per_token / flops
    assert m.step_time(with_encoder) - m.step_time(base) == pytest.approx(want, rel=1e-9)
    # a text model has no encoder cost
    assert TimingModel(get_profile("llama-3.1-70b-8xh100")).step_time(with_encoder) == TimingModel(
        get_profile("llama-3.1-70b-8xh100")
    ).step_time(base)


def test_a_preempted_request_encodes_its_items_again() -> None:
    window, cache = EncoderWindow([("x", 10, 20)]), EncoderCache(0)
    assert window.encode(0, 32, cache) == 20
    window.reset()
    assert window.encode(0, 32, cache) == 20
