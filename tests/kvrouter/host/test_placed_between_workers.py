"""New prompts placed by the workers of one host: each counts the others' placements (through the host's
rings), so the band's balance key sees the whole host's and the host places as one process would.

Two routers over one real ``HostMemory``, each with its own index of four full caches (the footprint then
tells the targets apart no more, as under cache pressure): whichever worker places each of a run of new
prompts, the targets' shares stay within one prompt of each other all along.  Counting only its own
placements, each worker balances its share alone, and the host's sum drifts apart.
"""

from __future__ import annotations

import threading
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from indexer import Indexer
from indexer.encode import PayloadEncoder
from kvrouter.host import HostLayout, HostMemory, SpeculativeRings
from kvrouter.host.wiring import RingSync
from kvrouter.routing import RouteInput, Router, RouterConfig
from kvrouter.routing.router import Target
from kvrouter.types import InstanceId, RequestId

BS = 16
ENC = PayloadEncoder()
TARGETS = [Target(InstanceId(f"v{i}")) for i in range(4)]


def full_index() -> Indexer:
    ix = Indexer(BS)
    for i in range(4):
        toks = list(range(10**6 * (i + 1), 10**6 * (i + 1) + 50 * BS))
        ix.apply_payload(f"v{i}", ENC.batch([ENC.stored(list(range(1, 51)), None, toks, BS)], ts=1.0))
    return ix


def host_routers(workers: int) -> list[Router]:
    layout = HostLayout(workers=workers, targets=4, instances=4, ring_words=4096)
    mem = HostMemory(layout, bytearray(layout.size()), threading.Lock())
    out = []
    for k in range(workers):
        ix = full_index()
        out.append(Router(ix, RouterConfig(shadow=False), host=RingSync(ix, SpeculativeRings(mem, k))))
    return out


def place(order: list[int], share: bool) -> int:
    """Prompt ``g`` placed by worker ``order[g]``, each finished before the next (no entries left): the
    widest spread of the targets' counts along the way."""
    routers = host_routers(2)
    got: Counter[str] = Counter()
    widest = 0
    for g, w in enumerate(order):
        toks = list(range(100_000 * (g + 1), 100_000 * (g + 1) + 100 * BS + 7))
        r = routers[w]
        inp = RouteInput(RequestId(f"g{g}"), len(toks), r.indexer.chain_hashes(toks), f"group {g}".encode())
        d = r.route(inp, TARGETS, now=float(g))
        assert d.chosen is not None and inp.chains is not None
        r.placed_new(inp.chains, d.chosen, float(g), share=share)
        got[d.chosen.target] += 1
        counts = [got.get(t.key, 0) for t in TARGETS]
        widest = max(widest, max(counts) - min(counts))
    return widest


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 1), min_size=1, max_size=16))
def test_a_hosts_workers_place_new_prompts_as_one(order: list[int]) -> None:
    assert place(order, share=True) <= 1


def test_a_worker_counting_only_its_own_placements_piles_them_up() -> None:
    """What the sharing is for: alone, each worker's own share is even, but not the host's."""
    orders = [
        [g % 2 for g in range(16)],
        [g // 8 for g in range(16)],
        [int(g in (1, 2, 5)) for g in range(8)],
    ]
    assert all(place(o, share=True) <= 1 for o in orders)
    assert max(place(o, share=False) for o in orders) >= 2
