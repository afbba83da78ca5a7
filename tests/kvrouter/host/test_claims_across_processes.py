"""Two worker processes racing for the last slot of a capped target through one host's shared memory (an
anonymous shared mapping and a process-shared lock, as ``kvrouter serve --workers`` makes them): however
their decisions interleave, the host never has more requests in flight there than the cap.

Each process claims, checks the host's count while it holds the slot, and finishes, many times over; the
processes run truly in parallel on a multi-core machine.  Checking the count and then adding to one's own
row (what a worker did before claims) lets both in at once within a few hundred rounds.
"""

from __future__ import annotations

import mmap
import multiprocessing
import os
from typing import Any

import pytest

from kvrouter.host import HostLayout, HostLoads, HostMemory
from kvrouter.routing.load import LoadTracker
from kvrouter.types import RequestId, TargetKey

T = TargetKey("only")
ROUNDS = 3000


def shared_memory(workers: int) -> HostMemory:
    layout = HostLayout(workers=workers, targets=4, instances=2, ring_words=64)
    buf = mmap.mmap(-1, layout.size(), flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    return HostMemory(layout, memoryview(buf), multiprocessing.get_context("fork").Lock())


def race(mem: HostMemory, me: int, cap: int, start: Any, out: Any) -> None:
    """Worker ``me``: claim, dispatch, count the host's requests in flight, finish; report (me, slots
    taken, times the host was seen over the cap)."""
    loads = HostLoads(mem, me)
    tracker = LoadTracker(loads)
    slot = loads.slot(T)
    taken = over = 0
    start.wait()
    i = 0
    # ROUNDS attempts, and more until this process has held the slot once: on a loaded machine the others
    # may run all their rounds while this one waits for a core (bounded: the slot is free once they end)
    while i < ROUNDS or (taken == 0 and i < 100 * ROUNDS):
        i += 1
        rid = RequestId(f"{me}-{i}")
        if not tracker.claim(rid, T, cap):
            continue
        taken += 1
        tracker.dispatch(rid, T, 10)
        if int(loads.totals()[slot, 0]) > cap:
            over += 1
        tracker.finish(rid)
    out.put((me, taken, over))


@pytest.mark.parametrize("cap", [1, 2])
def test_the_cap_holds_for_the_host(cap: int) -> None:
    workers = 3
    mem = shared_memory(workers)
    HostLoads(mem, 0).slot(T)  # the slot exists before the fork, as the supervisor's targets do
    ctx = multiprocessing.get_context("fork")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=race, args=(mem, k, cap, start, out)) for k in range(workers)]
    for p in procs:
        p.start()
    start.set()
    got = sorted(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(10)
    assert [over for _, _, over in got] == [0] * workers, got
    assert all(taken > 0 for _, taken, _ in got), got  # every process took the slot at times
    assert int(HostLoads(mem, 0).totals()[:, 0].sum()) == 0  # every claim was taken and given back


pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="the race needs two cores")
