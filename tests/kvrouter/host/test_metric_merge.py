"""The host's /metrics out of every worker's registry (``kvrouter.host.metric_merge``): literal cases, and
a property test of the merge against a reference (plain sums of what each worker counted), through the
snapshots' wire form and the host's metrics board."""

from __future__ import annotations

import threading

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics
from prometheus_client.parser import text_string_to_metric_families

from kvrouter.host import HostLayout, HostMemory, MetricsBoard, SnapshotTooLarge
from kvrouter.host.metric_merge import Merge, Merged, decode, encode, merge, plus_base, policy_of, snapshot


def worker_registry(
    requests: dict[str, int], ttft: list[float], in_flight: float, tasks: int
) -> CollectorRegistry:
    r = CollectorRegistry(auto_describe=False)
    c = Counter("kvrouter_requests", "r", ["status"], registry=r)
    for status, n in requests.items():
        c.labels(status).inc(n)
    h = Histogram("kvrouter_upstream_ttft_seconds", "t", buckets=(0.1, 1.0), registry=r)
    for v in ttft:
        h.observe(v)
    Gauge("kvrouter_instance_in_flight", "f", registry=r).set(in_flight)
    Gauge("kvrouter_event_loop_tasks", "t", registry=r).set(tasks)
    Counter("kvrouter_indexer_events", "e", registry=r).inc(100)
    return r


def values(families: list) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for m in families for s in m.samples}


def wire(worker: int, r: CollectorRegistry):
    return decode(encode(snapshot(worker, r.collect())))


def test_policies() -> None:
    assert policy_of("kvrouter_requests", "counter") is Merge.SUM
    assert policy_of("kvrouter_instance_in_flight", "gauge") is Merge.HOST
    assert policy_of("kvrouter_shared_state_up", "gauge") is Merge.LEADER
    assert policy_of("kvrouter_event_loop_tasks", "gauge") is Merge.WORKER
    assert policy_of("kvrouter_indexer_events", "counter") is Merge.WORKER  # each worker ingests every event


def test_two_workers_merge_literally() -> None:
    a = wire(0, worker_registry({"200": 3, "429": 1}, [0.05, 0.5], in_flight=7, tasks=10))
    b = wire(1, worker_registry({"200": 2}, [2.0], in_flight=8, tasks=12))
    got = values(merge([a, b], me=1))
    assert got[("kvrouter_requests_total", (("status", "200"),))] == 5
    assert got[("kvrouter_requests_total", (("status", "429"),))] == 1
    assert got[("kvrouter_upstream_ttft_seconds_bucket", (("le", "0.1"),))] == 1
    assert got[("kvrouter_upstream_ttft_seconds_bucket", (("le", "+Inf"),))] == 3
    assert got[("kvrouter_upstream_ttft_seconds_count", ())] == 3
    assert abs(got[("kvrouter_upstream_ttft_seconds_sum", ())] - 2.55) < 1e-9
    assert got[("kvrouter_instance_in_flight", ())] == 8  # the scraping worker's view of the host
    assert got[("kvrouter_event_loop_tasks", (("worker", "0"),))] == 10
    assert got[("kvrouter_event_loop_tasks", (("worker", "1"),))] == 12
    assert got[("kvrouter_indexer_events_total", (("worker", "0"),))] == 100
    assert ("kvrouter_indexer_events_total", ()) not in got


def test_exemplars_survive_the_merge_newest_first() -> None:
    regs = []
    for w, trace in enumerate(("aa" * 16, "bb" * 16)):
        r = CollectorRegistry(auto_describe=False)
        Histogram("kvrouter_routing_decision_seconds", "d", buckets=(1.0,), registry=r).observe(
            0.5, {"trace_id": trace}
        )
        regs.append(wire(w, r))
    text = openmetrics(Merged(merge(regs, me=0))).decode()
    bucket = next(line for line in text.splitlines() if 'le="1.0"' in line)
    assert "# {trace_id=" in bucket and ("bb" * 16 in bucket or "aa" * 16 in bucket)


def test_a_replacement_starts_from_its_predecessors_last_counts() -> None:
    dead = wire(1, worker_registry({"200": 9}, [0.5, 0.5], in_flight=3, tasks=4))
    fresh = snapshot(1, worker_registry({"200": 1}, [], in_flight=0, tasks=5).collect())
    got = values(plus_base(fresh, dead).families)
    assert got[("kvrouter_requests_total", (("status", "200"),))] == 10
    assert got[("kvrouter_upstream_ttft_seconds_count", ())] == 2
    assert got[("kvrouter_event_loop_tasks", ())] == 5  # a gauge is the living worker's


counts = st.dictionaries(st.sampled_from(["200", "400", "429", "502"]), st.integers(0, 50), max_size=4)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(counts, st.lists(st.floats(0, 5), max_size=8)), min_size=1, max_size=5))
def test_merged_counts_are_the_sum_of_each_workers(workers: list[tuple[dict[str, int], list[float]]]) -> None:
    snaps = [wire(k, worker_registry(req, ttft, 0, 1)) for k, (req, ttft) in enumerate(workers)]
    got = values(merge(snaps, me=0))
    for status in ("200", "400", "429", "502"):
        want = sum(req.get(status, 0) for req, _ in workers)
        assert got.get(("kvrouter_requests_total", (("status", status),)), 0) == want
    for le, bound in (("0.1", 0.1), ("1.0", 1.0), ("+Inf", float("inf"))):
        want = sum(1 for _, ttft in workers for v in ttft if v <= bound)
        assert got[("kvrouter_upstream_ttft_seconds_bucket", (("le", le),))] == want
    # The exposition parses back (what Prometheus reads).
    from prometheus_client.exposition import generate_latest

    list(text_string_to_metric_families(generate_latest(Merged(merge(snaps, me=0))).decode()))


def board(workers: int, metric_bytes: int = 4096) -> HostMemory:
    layout = HostLayout(workers=workers, targets=2, instances=2, ring_words=16, metric_bytes=metric_bytes)
    return HostMemory(layout, bytearray(layout.size()), threading.Lock())


def test_board_rows_generations_and_liveness() -> None:
    mem = board(3)
    b0, b1, b2 = (MetricsBoard(mem, k) for k in range(3))
    assert b0.read(1) is None
    b1.set_live(True)
    b2.set_live(False)
    g = b0.ask()
    assert b0.pending(g) == [1]  # a worker not live is not waited for
    b1.publish(b"snapshot one", g)
    assert b0.pending(g) == []
    assert b0.read(1) == b"snapshot one"
    b1.publish(b"two")  # shorter: the length bounds what is read
    assert b0.read(1) == b"two"
    b1.clear_row(1)
    assert b0.read(1) == b"two"  # a dead worker's last snapshot stays
    try:
        b1.publish(b"x" * 5000)
    except SnapshotTooLarge:
        pass
    else:
        raise AssertionError("a snapshot larger than its row was accepted")
