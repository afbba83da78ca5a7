"""Process-level behaviour of the long-running commands, and the gateway's metric children."""

from __future__ import annotations

import gc
import weakref

from kvrouter.heap import freeze_startup_heap


def test_startup_heap_is_frozen_and_later_garbage_still_collected() -> None:
    """The long-running commands freeze what start-up left (a tokenizer's ~130k objects) out of the
    collector's reach; cyclic garbage made afterwards is still collected."""

    class Node:
        pass

    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() > 0
        a, b = Node(), Node()
        a.other, b.other = b, a  # type: ignore[attr-defined]
        gone = weakref.ref(a)
        del a, b
        gc.collect()
        assert gone() is None
    finally:
        gc.unfreeze()


def test_cached_label_children_count_like_prometheus_ones() -> None:
    """The gateway's per-request metrics keep their labels() children; the exposition is unchanged."""
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    from kvrouter.gateway.metrics import CachedCounter

    plain_reg, cached_reg = CollectorRegistry(), CollectorRegistry()
    plain = Counter("x", "doc", ["a", "b"], registry=plain_reg)
    cached = CachedCounter("x", "doc", ["a", "b"], registry=cached_reg)
    for a, b, n in [("p", "1", 2), ("q", "2", 1), ("p", "1", 3)]:
        plain.labels(a, b).inc(n)
        cached.labels(a, b).inc(n)
    plain.labels(a="r", b="3").inc()
    cached.labels(a="r", b="3").inc()
    assert cached.labels("p", "1") is cached.labels("p", "1")

    def samples(reg: CollectorRegistry) -> list[str]:  # creation timestamps aside
        return [x for x in generate_latest(reg).decode().splitlines() if "_created" not in x]

    assert samples(cached_reg) == samples(plain_reg) and len(samples(plain_reg)) == 5
