"""Prometheus exposition of the indexer, read from its state at scrape time (no global registry).

Counters live as plain attributes of the pure core and the shell; this collector turns them into metric
families when Prometheus scrapes, so the hot path never touches a metrics library.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .indexer import Indexer
from .subscriber import EventSubscriber
from .types import Medium, Trust

_BYTES_PER_ENTRY = 24  # cykhash int64->int64 entry (16 B) at its usual load factor


class IndexerCollector(Collector):
    def __init__(
        self, indexer: Indexer, subscriber: EventSubscriber | None = None, prefix: str = "kvrouter_indexer"
    ):
        self.indexer = indexer
        self.subscriber = subscriber
        self.prefix = prefix

    def collect(self) -> Iterator[Metric]:
        p, ix, c = self.prefix, self.indexer, self.indexer.counters
        for name, value, doc in (
            ("batches", c.batches, "Event batches received"),
            ("events", c.events, "Events decoded"),
            ("blocks_stored", c.blocks_stored, "Blocks stored (all media)"),
            ("blocks_removed", c.blocks_removed, "Blocks removed (all media)"),
            ("clears", c.clears, "AllBlocksCleared events applied"),
        ):
            yield CounterMetricFamily(f"{p}_{name}", doc, value=value)
        for name, counter, doc in (
            ("decode_errors", c.decode_errors, "Batches dropped because they did not decode, by reason"),
            ("event_errors", c.event_errors, "Events (or blocks) not applied, by reason"),
            ("skipped_events", c.skipped_events, "Events skipped on purpose (unknown tags, other KV groups)"),
        ):
            fam = CounterMetricFamily(f"{p}_{name}", doc, labels=["reason"])
            for reason, n in sorted(counter.items()):
                fam.add_metric([reason], n)
            yield fam
        entries = ix.index.total_entries()
        yield GaugeMetricFamily(f"{p}_index_entries", "(source, block, medium) entries held", value=entries)
        yield GaugeMetricFamily(
            f"{p}_index_bytes_estimate", "Estimated bytes of index maps", value=entries * 2 * _BYTES_PER_ENTRY
        )
        yield GaugeMetricFamily(
            f"{p}_speculative_entries",
            "Speculative (source, block) entries",
            value=ix.index.speculative_entries(),
        )
        blocks = GaugeMetricFamily(
            f"{p}_source_blocks", "Blocks held per source and medium", labels=["source", "medium"]
        )
        trust = GaugeMetricFamily(
            f"{p}_source_trust", "1 for the source's current trust level", labels=["source", "trust"]
        )
        seq = GaugeMetricFamily(f"{p}_source_seq", "Last applied sequence number", labels=["source"])
        lag = GaugeMetricFamily(
            f"{p}_source_lag_seconds", "Now minus the last batch's timestamp", labels=["source"]
        )
        gaps = CounterMetricFamily(f"{p}_gaps", "Sequence gaps detected", labels=["source"])
        unfilled = CounterMetricFamily(f"{p}_unfilled_gaps", "Gaps replay could not fill", labels=["source"])
        replays = CounterMetricFamily(f"{p}_replays", "Replays requested", labels=["source"])
        restarts = CounterMetricFamily(f"{p}_restarts", "Engine restarts detected", labels=["source"])
        dropped = CounterMetricFamily(
            f"{p}_dropped_pending",
            "Live batches dropped while a replay ran (max_pending reached; a gap replay fills later)",
            labels=["source"],
        )
        stale = CounterMetricFamily(
            f"{p}_stale_live",
            "Live batches skipped because a replay had already applied them (the socket's queue lagged)",
            labels=["source"],
        )
        mismatch = GaugeMetricFamily(
            f"{p}_block_size_mismatch",
            "Block size seen in events when it differs from the fleet's",
            labels=["source"],
        )
        connected = GaugeMetricFamily(
            f"{p}_source_connected", "1 if the event socket is connected", labels=["source"]
        )
        now = time.time()
        for src in ix.sources():
            label = src.label()
            for m, n in ix.index.blocks(src).items():
                blocks.add_metric([label, Medium(m).name], n)
            t = ix.trust(src)
            for level in Trust:
                trust.add_metric([label, level.value], 1.0 if level is t else 0.0)
            sync = ix.sync(src)
            seq.add_metric([label], -1 if sync.last is None else sync.last)
            ts = ix.last_event_ts.get(src)
            if ts is not None:
                lag.add_metric([label], max(0.0, now - ts))
            gaps.add_metric([label], sync.gaps)
            unfilled.add_metric([label], sync.unfilled)
            replays.add_metric([label], sync.replays)
            restarts.add_metric([label], sync.restarts)
            dropped.add_metric([label], sync.dropped_pending)
            stale.add_metric([label], sync.stale_live)
            mismatch.add_metric([label], ix.block_size_mismatch.get(src, 0))
            if self.subscriber is not None and src in self.subscriber.status:
                connected.add_metric([label], 1.0 if self.subscriber.status[src].connected else 0.0)
        yield from (
            blocks,
            trust,
            seq,
            lag,
            gaps,
            unfilled,
            replays,
            restarts,
            dropped,
            stale,
            mismatch,
            connected,
        )
        if self.subscriber is not None:
            fam = CounterMetricFamily(
                f"{p}_transport", "Transport events (connects, replays, bad frames)", labels=["kind"]
            )
            for kind, n in sorted(self.subscriber.counters.items()):
                fam.add_metric([kind], n)
            yield fam


def make_registry(indexer: Indexer, subscriber: EventSubscriber | None = None) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(IndexerCollector(indexer, subscriber))
    return reg
