"""Process-level heap settings for the long-running commands (serve, indexer, sim): the start-up heap
frozen out of the collector's way, and the C allocator's free memory given back to the kernel."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import logging
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from .allocator import active as active_allocator

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
    trim_heap()  # loading left the allocator holding what it freed (tokenizer files parsed, imports)
    log.debug(
        "startup heap frozen",
        extra={"objects": gc.get_freeze_count(), "freeze_ms": round((time.perf_counter() - t0) * 1e3, 2)},
    )


async def freeze_on_startup(_app: Any) -> None:
    """``aiohttp`` on_startup hook: ``freeze_startup_heap`` once the application's own start-up (loading
    tokenizers, subscribing) has run."""
    freeze_startup_heap()


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc with ``malloc_trim`` and ``mallinfo2`` (2.33+) and it is the
    allocator in use; None elsewhere (under jemalloc glibc's arenas hold nothing: ``kvrouter.allocator``)."""
    if active_allocator() != "system":
        return None
    try:
        lib = ctypes.CDLL(None)
        lib.malloc_trim.argtypes = [ctypes.c_size_t]
        lib.malloc_trim.restype = ctypes.c_int
        lib.mallinfo2.argtypes = []
        lib.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return None
    return lib


_LIBC = _glibc()


def heap_free_bytes() -> int | None:
    """Bytes the C allocator holds free in its arenas (glibc ``mallinfo2().fordblks``); None elsewhere."""
    return None if _LIBC is None else int(_LIBC.mallinfo2().fordblks)


def trim_heap() -> bool:
    """Give the C allocator's free pages back to the kernel (glibc ``malloc_trim(0)``: the top of each
    arena and every free page inside it).  False where there is no glibc."""
    if _LIBC is None:
        return False
    _LIBC.malloc_trim(0)
    return True


TRIM_INTERVAL_S = 10.0
TRIM_MIN_FREE_BYTES = 32 << 20


class HeapTrimmer:
    """Returns the C allocator's free memory to the kernel when it holds much of it, every ``interval_s``.

    Python asks the C allocator for every object past 512 bytes (a request body, a prompt's token list, a
    parsed JSON document).  glibc keeps what is freed inside its arenas for later, and returns it only
    from the top of an arena: after a peak of requests in flight the process keeps the peak's memory, and
    each new peak adds to it, so memory climbs step by step under a load that is steady on average
    (docs/measurements.md, "gateway memory under steady load").  Trimming costs a pass over the free
    chunks (milliseconds, on the event loop), so it runs only when ``min_free_bytes`` are free; reading
    that costs a pass over the bins."""

    def __init__(
        self,
        interval_s: float = TRIM_INTERVAL_S,
        min_free_bytes: int = TRIM_MIN_FREE_BYTES,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.interval_s = interval_s
        self.min_free_bytes = min_free_bytes
        self.trims = Counter(
            "kvrouter_heap_trims",
            "Times the C allocator's free memory was given back to the kernel",
            registry=registry,
        )
        self.free = Gauge(
            "kvrouter_heap_free_bytes",
            "Bytes the C allocator held free in its arenas at the last look (before any trim)",
            registry=registry,
        )
        self.allocator = Gauge(
            "kvrouter_allocator",
            "1 for the C allocator this process runs on (jemalloc or system: KVROUTER_ALLOCATOR)",
            ["allocator"],
            registry=registry,
        )
        self.allocator.labels(active_allocator()).set(1)
        self._task: asyncio.Task[None] | None = None
        self._base: int | None = None

    def check(self) -> bool:
        """Trim if ``min_free_bytes`` more are free than at the last trim (or the least seen since): the
        free bytes count pages already given back too, so only their growth says a peak has passed."""
        free = heap_free_bytes()
        if free is None:
            return False
        self.free.set(free)
        self._base = free if self._base is None else min(self._base, free)
        if free - self._base < self.min_free_bytes:
            return False
        t0 = time.perf_counter()
        trim_heap()
        self._base = free
        self.trims.inc()
        log.debug(
            "heap trimmed",
            extra={"free_mb": round(free / 2**20, 1), "trim_ms": round((time.perf_counter() - t0) * 1e3, 2)},
        )
        return True

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.check()

    def start(self) -> None:
        if self._task is None and _LIBC is not None:
            self._task = asyncio.create_task(self._run(), name="heap-trim")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
