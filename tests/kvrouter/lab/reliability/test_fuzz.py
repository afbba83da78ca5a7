"""Bad input on the event path: a quick run of the decoder + index fuzz (the 100,000-payload run is in
``kvrouter reliability`` and the slow suite), and literal regressions for what the fuzz found."""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
import pytest

from indexer import ConfigError, Indexer, SourceKey, Trust
from indexer.config import FleetConfig, IndexerOptions, InstanceConfig, parse_fleet
from indexer.encode import PayloadEncoder
from indexer.subscriber import EventSubscriber
from indexer.wire import MAX_DP_RANK
from kvrouter.lab.reliability.event_fuzz import EventFuzzConfig, event_fuzz_result, run_event_fuzz
from kvrouter.lab.sim.engine import BlockStored
from kvrouter.lab.sim.engine.types import BlockHash
from kvrouter.lab.sim.server.publisher import EventPublisher, PublisherConfig
from tests.support.net import free_port
from tests.support.wait import until

BS = 16
TS = b"\xcb" + struct.pack(">d", 1.7e9)
SRC = SourceKey("v0", 0)


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


FIRST = list(range(100, 100 + BS))
LAST = list(range(500, 500 + BS))


@asynccontextmanager
async def probed_source(
    *, early: bool = False
) -> AsyncIterator[tuple[EventPublisher, Indexer, EventSubscriber]]:
    """A publisher with replay and a subscriber probing it after a second of quiet, source ``SRC``; the
    block of ``FIRST`` published once the subscriber is connected, or before it joins (``early``)."""
    port, rport = free_port(), free_port()
    pub = EventPublisher(
        PublisherConfig(endpoint=f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{rport}")
    )
    await pub.start()
    if early:
        pub.publish([BlockStored([BlockHash(11)], None, FIRST, BS)])  # before anyone listens
    ix = Indexer(BS)
    inst = InstanceConfig("v0", events=f"tcp://127.0.0.1:{port}", replay=f"tcp://127.0.0.1:{rport}")
    # Quiet for a second before a probe: a test reads its counters well before the first could go out.
    opts = IndexerOptions(idle_probe_s=1.0)
    sub = EventSubscriber(ix, FleetConfig(block_size=BS, instances=[inst], indexer=opts))
    await sub.start()
    try:
        if not early:
            await until(lambda: sub.status[SRC].connected)
            pub.publish([BlockStored([BlockHash(11)], None, FIRST, BS)])
        await until(lambda: held(ix, FIRST) == 1)
        # and the join's replay request received: the tests count the requests that follow
        await until(lambda: pub.stats.replay_requests >= sub.counters["replay_requests"])
        yield pub, ix, sub
    finally:
        await sub.stop()
        await pub.stop()


async def lose_last(pub: EventPublisher, ix: Indexer, sub: EventSubscriber) -> None:
    """Publish the block of ``LAST`` and lose it (nothing follows it), then wait until the index holds it:
    only a probe's replay can bring it.  A wait that fails reports both sides' counters."""
    pub.set_drop_rate(1.0)
    pub.publish([BlockStored([BlockHash(22)], None, LAST, BS)])
    try:
        await until(lambda: held(ix, LAST) == 1, what="the lost batch found")
    except AssertionError as e:
        raise AssertionError(f"{e}: {state(sub, pub, ix)}") from None
    assert (pub.stats.batches, pub.stats.dropped) == (2, 1)  # no later batch could have revealed it


async def test_a_lost_last_batch_is_found_by_the_idle_probe() -> None:
    """vLLM sends no heartbeat: a dropped final batch is fetched by one replay once the source is quiet,
    the one probe of that quiet spell (counted on both sides; nothing is published after the loss)."""
    async with probed_source() as (pub, ix, sub):
        probes, asked = sub.counters["idle_probes"], pub.stats.replay_requests
        await lose_last(pub, ix, sub)
        # one probe after the loss (two if the quiet spell's first probe went out before the loss: a
        # loop stalled a second between the first batch and the publish)
        assert sub.counters["idle_probes"] - probes in (1, 2)
        assert pub.stats.replay_requests - asked == sub.counters["idle_probes"] - probes
        assert ix.trust(SRC) is Trust.EXACT


async def test_a_batch_lost_after_a_probe_is_found_by_the_next() -> None:
    """A quiet source is probed again at doubling intervals: a batch lost after the spell's first probe,
    with nothing following it, is found by the second (1 s, then 2 s later), not never."""
    async with probed_source() as (pub, ix, sub):
        # The spell's first probe, answered: the publisher has received every replay request the
        # subscriber sent (it takes what it replays when a request arrives), so the batch lost below
        # cannot ride on it.  Waiting only for the probe to be sent let a slow request see the batch.
        await until(
            lambda: (
                sub.counters["idle_probes"] >= 1
                and pub.stats.replay_requests >= sub.counters["replay_requests"]
            )
        )
        assert sub.status[SRC].probes >= 1 and pub.stats.replay_requests >= 1
        await lose_last(pub, ix, sub)
        assert sub.counters["idle_probes"] >= 2 and ix.trust(SRC) is Trust.EXACT


async def test_a_source_heard_only_by_replay_is_probed_too() -> None:
    """A batch published before the subscriber joined arrives by the join's replay, not by the PUB
    socket; a batch lost after it, with nothing following, is still found by the idle probe."""
    async with probed_source(early=True) as (pub, ix, sub):
        assert sub.status[SRC].messages == 0  # it came by replay alone
        await lose_last(pub, ix, sub)
        assert sub.counters["idle_probes"] >= 1 and ix.trust(SRC) is Trust.EXACT


def state(sub: EventSubscriber, pub: EventPublisher, ix: Indexer) -> str:
    """What a failed wait reports: the subscriber's counters, the publisher's, the source's phase."""
    sync = ix.sync(SRC)
    return (
        f"subscriber {dict(sub.counters)}, publisher {pub.stats}, {sync.phase} {sync.last}, {sub.status[SRC]}"
    )


def held(ix: Indexer, tokens: list[int]) -> int:
    return max((m.matched_blocks for m in ix.lookup(tokens).instances), default=0)


def test_payload_encoder_round_trip_still_holds() -> None:
    """The decoder changes keep every release's golden shape decodable."""
    for release in ("0.9.0", "0.23.0", "0.33.0"):
        enc = PayloadEncoder(release)
        p = enc.batch([enc.stored([1, 2], None, list(range(2 * BS)), BS)], ts=1.0)
        ix = Indexer(BS)
        assert ix.apply_payload("v", p) == 1 and held(ix, list(range(2 * BS))) == 2


def test_the_probes_longest_interval_is_checked_against_the_first() -> None:
    with pytest.raises(ConfigError, match="idle_probe_max_s"):
        parse_fleet({"block_size": BS, "instances": [], "indexer": {"idle_probe_max_s": 0.5}}, FleetConfig)
    cfg = parse_fleet({"block_size": BS, "instances": [], "indexer": {"idle_probe_s": 0}}, FleetConfig)
    assert cfg.indexer.idle_probe_max_s == 60.0  # probes off: the bound is not read
