"""Two workers of one host, built over one block of shared memory (``Gateway(cfg, host=WorkerHost(...))``):
what one worker counts, the other sees, because each gateway's parts are built over the host's state
rather than their own.  In one process, over a ``bytearray`` (the workers' fork is tested end to end in
``test_serve_workers.py``)."""

from __future__ import annotations

import threading

import numpy as np

from indexer.config import parse_fleet
from indexer.types import SourceKey
from kvrouter.config import RouterFleetConfig
from kvrouter.gateway import Gateway
from kvrouter.host import HostLayout, HostMemory
from kvrouter.host.wiring import WorkerHost
from kvrouter.types import RequestId, TargetKey


def fleet() -> RouterFleetConfig:
    return parse_fleet(
        {
            "block_size": 16,
            "instances": [
                {"name": "a", "url": "http://127.0.0.1:9"},
                {"name": "b", "url": "http://127.0.0.1:9"},
            ],
        },
        RouterFleetConfig,
    )


def two_workers() -> tuple[Gateway, Gateway]:
    cfg = fleet()
    layout = HostLayout(workers=2, targets=8, instances=4, ring_words=256)
    mem = HostMemory(layout, bytearray(layout.size()), threading.Lock())
    return (
        Gateway(cfg, subscribe=False, host=WorkerHost(mem, 0)),
        Gateway(cfg, subscribe=False, host=WorkerHost(mem, 1)),
    )


def test_a_request_in_one_worker_loads_the_target_in_the_other() -> None:
    w0, w1 = two_workers()
    a = TargetKey("a")
    w0.router.load.dispatch(RequestId("w0-r0"), a, 64)
    w1.router.load.refresh()
    assert w1.router.load.loads[a].effective_in_flight() == 1
    w0.router.load.finish(RequestId("w0-r0"))
    w1.router.load.refresh()
    assert w1.router.load.loads[a].effective_in_flight() == 0


def test_speculative_entries_reach_the_other_worker_through_the_rings() -> None:
    w0, w1 = two_workers()
    src = SourceKey("a", 0)
    chains = np.array([11, 22, 33], dtype=np.int64)
    w0.indexer.add_speculative(src, chains, now=0.0)
    assert w1.indexer.index.speculative_blocks(src) == 0
    assert w0.router.host is not None and w1.router.host is not None
    w0.router.host.push()
    w1.router.host.pull()
    assert w1.indexer.index.speculative_blocks(src) == 3


def test_requests_held_count_for_the_whole_host() -> None:
    w0, w1 = two_workers()
    assert w1.pipeline.admission.held_host is not None
    with w0.pipeline.held():
        assert w1.pipeline.admission.held_host.held_total() == 1
    assert w1.pipeline.admission.held_host.held_total() == 0


def test_each_worker_has_its_ids_and_only_the_leader_leads() -> None:
    w0, w1 = two_workers()
    assert str(w0.pipeline.prepare_bodyless().inp.request_id).startswith("w0-r")
    assert str(w1.pipeline.prepare_bodyless().inp.request_id).startswith("w1-r")
    assert (w0.leader, w1.leader) == (True, False)
    assert (w0.pool.scrape_engines, w1.pool.scrape_engines) == (True, False)
    assert w1.host_state is not None and w1.host_state()["worker"] == 1
