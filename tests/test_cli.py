"""Process-level behaviour of the long-running commands."""

from __future__ import annotations

import gc
import weakref

from kvrouter.commands.heap import freeze_startup_heap


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
