"""Process-level heap setting for the long-running commands (serve, indexer, sim)."""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

log = logging.getLogger("kvrouter.heap")


def freeze_startup_heap() -> None:
    """Move every object alive after start-up into the collector's permanent generation.

    A loaded Hugging Face tokenizer leaves ~130,000 tracked objects (vocabularies, merges, transformers'
    module state) that live as long as the process.  Each full collection traversed them all (tens of
    milliseconds: docs/measurements.md, "start-up heap"), a stall of the event loop, and so of every
    request in flight, whenever
    the request path's own allocations triggered one.  Frozen, a full collection takes microseconds.
    Called once, when nothing is in flight: objects frozen are never freed, so a later call could pin a
    request's garbage.
    """
    gc.collect()
    t0 = time.perf_counter()
    gc.freeze()
    log.debug(
        "startup heap frozen",
        extra={"objects": gc.get_freeze_count(), "freeze_ms": round((time.perf_counter() - t0) * 1e3, 2)},
    )


async def freeze_on_startup(_app: Any) -> None:
    """``aiohttp`` on_startup hook: ``freeze_startup_heap`` once the application's own start-up (loading
    tokenizers, subscribing) has run."""
    freeze_startup_heap()
