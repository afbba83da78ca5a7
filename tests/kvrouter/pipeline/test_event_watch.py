"""``EventWatch``: a source whose live stream stays silent while its instance computes prompts is deaf."""

from __future__ import annotations

from indexer.types import SourceKey
from kvrouter.pipeline.event_watch import EventWatch

A, B = SourceKey("a", 0), SourceKey("b", 0)


def test_silent_while_computing_blocks_is_deaf_and_a_batch_clears_it() -> None:
    w = EventWatch(32, after_requests=3, grace_s=5.0)
    for t in (0.0, 1.0, 2.0):
        w.served(A, 100, 0, t)  # three full blocks computed each time
    assert w.check({A: 0}, 4.0) == ([], [])  # the oldest owed batch may still be on its way
    assert w.check({A: 0}, 5.5) == ([A], [])
    assert w.deaf[A].owed_requests == 3
    assert w.check({A: 0}, 8.0) == ([], [])  # said once
    assert w.check({A: 4}, 9.0) == ([], [A]) and not w.deaf


def test_cache_hits_and_partial_blocks_owe_nothing() -> None:
    w = EventWatch(32, after_requests=1, grace_s=0.0)
    w.served(A, 100, 96, 0.0)  # every full block was cached: vLLM publishes nothing
    w.served(A, 31, 0, 0.0)  # no full block
    w.served(A, None, None, 0.0)  # no usage reported
    assert w.check({A: 0}, 10.0) == ([], [])


def test_a_source_that_publishes_is_never_deaf_and_unwatched_sources_are_dropped() -> None:
    w = EventWatch(32, after_requests=1, grace_s=0.0)
    w.served(A, 64, 0, 0.0)
    w.served(B, 64, 0, 0.0)
    assert w.check({A: 1, B: 0}, 1.0) == ([B], [])
    assert w.check({A: 1}, 2.0) == ([], []) and not w.deaf  # B left the fleet
