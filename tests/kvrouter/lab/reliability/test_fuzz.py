"""Bad input on the event path: a quick run of the decoder + index fuzz (the 100,000-payload run is in
``kvrouter reliability`` and the slow suite), and literal regressions for what the fuzz found."""

from __future__ import annotations

import asyncio
import struct
import time

import msgspec
import pytest

from indexer import Indexer, SourceKey, Trust
from indexer.config import FleetConfig, IndexerOptions, InstanceConfig
from indexer.encode import PayloadEncoder
from indexer.subscriber import EventSubscriber
from indexer.wire import MAX_DP_RANK
from kvrouter.lab.reliability.event_fuzz import EventFuzzConfig, event_fuzz_result, run_event_fuzz
from kvrouter.lab.sim.engine import BlockStored
from kvrouter.lab.sim.engine.types import BlockHash
from kvrouter.lab.sim.server.publisher import EventPublisher, PublisherConfig
from tests.support.net import free_port

BS = 16
TS = b"\xcb" + struct.pack(">d", 1.7e9)


def test_a_quick_fuzz_run_holds_every_property() -> None:
    """Every property but speed: how long the slowest payload takes is a figure of ``kvrouter
    reliability`` (event-fuzz), not a wall-clock bound here (a hang ends the test at pytest's timeout)."""
    rep = run_event_fuzz(EventFuzzConfig(payloads=4000, seed=3, huge_every=2000))
    assert rep.crashes == [] and rep.uncounted == [] and rep.wrong_reason == []
    assert rep.control_batches > 30 and rep.control_errors == 0
    assert rep.control_mismatches == 0 and rep.control_trust == "exact"
    assert len(rep.families) >= 24  # every family came up at least once
    assert {"decode:msgpack", "event:unknown_parent", "skipped:unknown_tag"} <= set(rep.rejections)


def test_the_scenario_reports_passing_figures() -> None:
    res = event_fuzz_result(EventFuzzConfig(payloads=500, seed=4, huge_every=0))
    assert res.ok, [f for f in res.figures if f.ok is False]


@pytest.mark.slow
def test_a_hundred_thousand_payloads() -> None:
    rep = run_event_fuzz(EventFuzzConfig(payloads=100_000, seed=0))
    assert rep.crashes == [] and rep.uncounted == [] and rep.wrong_reason == []
    assert rep.slow == 0 and rep.control_errors == 0 and rep.control_mismatches == 0


# ---------------------------------------------------------------------------------------------- regressions
def stored_event(tag_bytes: bytes = b"\xabBlockStored") -> bytes:
    """A positional BlockStored of one block whose tag string is ``tag_bytes``."""
    enc = msgspec.msgpack.encode
    return b"\x97" + tag_bytes + enc([1]) + b"\xc0" + enc(list(range(BS))) + enc(BS) + b"\xc0\xa3GPU"


@pytest.mark.parametrize(
    "payload,reasons",
    [
        # a str that is not UTF-8 (msgspec raises UnicodeDecodeError, not DecodeError)
        (b"\x93" + TS + b"\x91" + stored_event(b"\xab\xffBlockStore") + b"\x00", {"skipped:msgpack"}),
        (b"\x93" + TS + b"\x91\x81\xa4type\xa2\xff\xfe\x00", {"skipped:msgpack"}),
        (b"\x82\xa2ts" + TS + b"\xa6ev\xffnts\x90", {"decode:msgpack", "decode:batch_shape"}),
        # nesting beyond the recursion limit (RecursionError): an event, and a batch that cannot be split
        (b"\x93" + TS + b"\x91" + b"\x91" * 5000 + b"\xc0\x00", {"decode:too_deep"}),
        (b"\x93" + TS + b"\x92" + stored_event() + b"\x91" * 5000 + b"\xc0\x00", {"decode:too_deep"}),
        (b"\x93" + TS + b"\x90" + b"\x91" * 5000 + b"\xc0", {"decode:batch_shape"}),
        # a rank no deployment has: refused instead of becoming a source of its own
        (msgspec.msgpack.encode([1.7e9, [], MAX_DP_RANK + 1]), {"decode:batch_shape"}),
        (msgspec.msgpack.encode([1.7e9, [], 1 << 63]), {"decode:batch_shape"}),
    ],
)
def test_hostile_payloads_are_counted_never_raised(payload: bytes, reasons: set[str]) -> None:
    ix = Indexer(BS)
    ix.apply_payload("v", payload)  # must not raise
    c = ix.counters
    seen = {f"decode:{k}" for k in c.decode_errors} | {f"skipped:{k}" for k in c.skipped_events}
    seen |= {f"event:{k}" for k in c.event_errors}
    assert seen & reasons, seen
    assert len(ix.sources()) <= 1


def test_deep_extra_keys_are_an_event_error() -> None:
    """extra_keys nested just under the decoder's limit decode, then cannot be re-encoded for hashing."""
    ix = Indexer(BS)
    enc = msgspec.msgpack.encode
    deep = b"\x91" * 990 + b"\xc0"
    ev = (
        b"\x9a\xabBlockStored" + enc([1]) + b"\xc0" + enc(list(range(BS))) + enc(BS) + b"\xc0\xa3GPU\xc0\x91"
        + deep + b"\x00"
    )  # fmt: skip
    ix.apply_payload("v", b"\x93" + TS + b"\x91" + ev + b"\x00")
    c = ix.counters
    assert sum(c.decode_errors.values()) + sum(c.skipped_events.values()) + sum(c.event_errors.values()) == 1


async def test_a_lost_last_batch_is_found_by_the_idle_probe() -> None:
    """vLLM sends no heartbeat: a dropped final batch is fetched by one replay once the source is quiet,
    the one probe of that quiet spell (counted on both sides; nothing is published after the loss)."""
    port, rport = free_port(), free_port()
    pub = EventPublisher(
        PublisherConfig(endpoint=f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{rport}")
    )
    await pub.start()
    ix = Indexer(BS)
    inst = InstanceConfig("v0", events=f"tcp://127.0.0.1:{port}", replay=f"tcp://127.0.0.1:{rport}")
    # Quiet for a second before a probe: the test reads its counters well before the first could go out.
    opts = IndexerOptions(idle_probe_s=1.0)
    sub = EventSubscriber(ix, FleetConfig(block_size=BS, instances=[inst], indexer=opts))
    await sub.start()
    src = SourceKey("v0", 0)
    try:
        await until(lambda: sub.status[src].connected)
        first = list(range(100, 100 + BS))
        pub.publish([BlockStored([BlockHash(11)], None, first, BS)])
        await until(lambda: held(ix, first) == 1)
        probes, asked = sub.counters["idle_probes"], pub.stats.replay_requests
        pub.set_drop_rate(1.0)
        last = list(range(500, 500 + BS))
        pub.publish([BlockStored([BlockHash(22)], None, last, BS)])  # lost, and nothing follows it
        await until(lambda: held(ix, last) == 1)
        assert (pub.stats.batches, pub.stats.dropped) == (2, 1)  # no later batch could have revealed it
        assert sub.counters["idle_probes"] == probes + 1 and pub.stats.replay_requests == asked + 1
        assert ix.trust(src) is Trust.EXACT
    finally:
        await sub.stop()
        await pub.stop()


def held(ix: Indexer, tokens: list[int]) -> int:
    return max((m.matched_blocks for m in ix.lookup(tokens).instances), default=0)


async def until(cond: object, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


def test_payload_encoder_round_trip_still_holds() -> None:
    """The decoder changes keep every release's golden shape decodable."""
    for release in ("0.9.0", "0.23.0", "0.33.0"):
        enc = PayloadEncoder(release)
        p = enc.batch([enc.stored([1, 2], None, list(range(2 * BS)), BS)], ts=1.0)
        ix = Indexer(BS)
        assert ix.apply_payload("v", p) == 1 and held(ix, list(range(2 * BS))) == 2
