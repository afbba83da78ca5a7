"""The heap trimmer: after a peak of allocations is freed, the C allocator's free memory goes back to the
kernel (resident memory falls), and only when the free bytes grew since the last trim."""

from __future__ import annotations

import gc
import random
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kvrouter.heap import HeapTrimmer, heap_free_bytes

pytestmark = pytest.mark.skipif(heap_free_bytes() is None, reason="glibc's malloc_trim / mallinfo2 only")


def rss_anon_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no RssAnon")


def trims(reg: CollectorRegistry) -> float:
    return reg.get_sample_value("kvrouter_heap_trims_total") or 0.0


def test_a_freed_peak_goes_back_to_the_kernel_once() -> None:
    reg = CollectorRegistry()
    t = HeapTrimmer(min_free_bytes=16 << 20, registry=reg)
    rng = random.Random(0)
    # a peak: 120 MB in blocks past pymalloc's 512 bytes and under glibc's mmap threshold (from malloc's
    # arenas, as request bodies and token lists are), a few of them kept so the arena cannot shrink by
    # its top alone
    peak = [bytes(rng.randrange(1_000, 8_000)) for _ in range(30_000)]
    kept = peak[::50]
    # The first look sets the baseline, taken at the peak: a process that already held free memory
    # (earlier tests in the same worker) serves the peak from it, so a baseline taken before the peak
    # could see no growth at all once the peak is freed.
    assert not t.check()
    del peak
    gc.collect()
    before = rss_anon_mb()
    assert t.check()
    after = rss_anon_mb()
    assert trims(reg) == 1
    assert after < before - 50, (before, after)
    assert not t.check()  # nothing new freed since: no second trim
    assert trims(reg) == 1 and kept
