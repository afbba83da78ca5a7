"""The host's /metrics out of every worker's own: each worker's registry as a msgpack ``Snapshot`` on the
host's metrics board, merged at scrape time into one exposition whose counters never go down.

How a family is merged (``policy_of``):

    SUM     counters, histograms (bucket by bucket, exemplar: the newest), summaries, and gauges whose
            workers' values add up to the host's (open ext_proc streams).  ``_created``: the earliest.
    HOST    gauges every worker reads from the host's shared state (in flight, health, the queue):
            the scraping worker's value, fresh as of this scrape.
    LEADER  gauges only worker 0 keeps (shared-state round trips, index snapshots): worker 0's value.
    WORKER  per-worker values, labelled ``worker``: each worker's own index and membership runtime
            (every worker ingests every event, so a sum would count each event once per worker).

Invariant: a worker replaced after a crash starts from the counts its predecessor last showed
(``plus_base``), so a counter never shows less than it did.  Pure: no I/O, no clock.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

import msgspec
from prometheus_client.core import Metric
from prometheus_client.samples import Exemplar


class Merge(enum.Enum):
    SUM = "sum"
    HOST = "host"
    LEADER = "leader"
    WORKER = "worker"


WORKER_PREFIXES = ("kvrouter_indexer_", "kvrouter_membership_")
"""Families that describe state each worker holds a copy of (its own index, its own membership view)."""

GAUGES: dict[str, Merge] = {
    "kvrouter_instance_in_flight": Merge.HOST,
    "kvrouter_instance_healthy": Merge.HOST,
    "kvrouter_queue_depth": Merge.HOST,
    "kvrouter_shared_state_up": Merge.LEADER,
    "kvrouter_shared_state_peers": Merge.LEADER,
    "kvrouter_index_snapshot_bytes": Merge.LEADER,
    "kvrouter_epp_open_streams": Merge.SUM,
    "kvrouter_flow_queue_depth": Merge.SUM,
    "kvrouter_flow_accounts": Merge.LEADER,
}
"""Gauges with a host-wide meaning; any other gauge is per worker (labelled)."""

_MONOTONE = frozenset({"counter", "histogram", "summary", "gaugehistogram"})


def policy_of(name: str, typ: str) -> Merge:
    if name.startswith(WORKER_PREFIXES):
        return Merge.WORKER
    if typ == "gauge":
        return GAUGES.get(name, Merge.WORKER)
    return Merge.SUM if typ in _MONOTONE else Merge.WORKER


class WireExemplar(msgspec.Struct, array_like=True, gc=False):
    labels: dict[str, str]
    value: float
    timestamp: float | None = None


class WireSample(msgspec.Struct, array_like=True, gc=False):
    name: str
    labels: dict[str, str]
    value: float
    exemplar: WireExemplar | None = None


class WireFamily(msgspec.Struct, array_like=True, gc=False):
    name: str
    type: str
    help: str
    unit: str
    samples: list[WireSample]


class Snapshot(msgspec.Struct, array_like=True):
    """One worker's metrics at one instant."""

    worker: int
    families: list[WireFamily]


_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(Snapshot)


def encode(s: Snapshot) -> bytes:
    return _ENC.encode(s)


def decode(raw: bytes) -> Snapshot:
    """``msgspec.DecodeError`` when ``raw`` is not a snapshot."""
    return _DEC.decode(raw)


def _ts(t: object) -> float | None:
    if t is None:
        return None
    if isinstance(t, int | float):
        return float(t)
    return float(t.sec) + float(t.nsec) / 1e9  # type: ignore[attr-defined]


def _exemplar(e: Exemplar) -> WireExemplar:
    return WireExemplar(dict(e.labels), float(e.value), _ts(e.timestamp))


def snapshot(worker: int, families: Iterable[Metric]) -> Snapshot:
    out = []
    for m in families:
        samples = [
            WireSample(
                s.name,
                dict(s.labels),
                float(s.value),
                None if s.exemplar is None else _exemplar(s.exemplar),
            )
            for s in m.samples
        ]
        out.append(WireFamily(m.name, m.type, m.documentation, m.unit, samples))
    return Snapshot(worker, out)


_Key = tuple[str, tuple[tuple[str, str], ...]]


def _key(s: WireSample) -> _Key:
    return s.name, tuple(sorted(s.labels.items()))


def _newer(a: WireExemplar | None, b: WireExemplar | None) -> WireExemplar | None:
    if a is None or b is None:
        return a or b
    return b if (b.timestamp or 0.0) > (a.timestamp or 0.0) else a


def _sum_into(acc: dict[_Key, WireSample], samples: list[WireSample]) -> None:
    for s in samples:
        k = _key(s)
        cur = acc.get(k)
        if cur is None:
            acc[k] = WireSample(s.name, s.labels, s.value, s.exemplar)
        elif s.name.endswith("_created"):
            cur.value = min(cur.value, s.value)
        else:
            cur.value += s.value
            cur.exemplar = _newer(cur.exemplar, s.exemplar)


def plus_base(own: Snapshot, base: Snapshot | None) -> Snapshot:
    """``own`` with a crashed predecessor's counters, histograms and summaries added (its gauges died with
    it)."""
    if base is None:
        return own
    fams = {f.name: f for f in own.families}
    acc: dict[str, dict[_Key, WireSample]] = {}
    for f in base.families:
        if f.type not in _MONOTONE:
            continue
        mine = fams.get(f.name)
        if mine is None:
            fams[f.name] = mine = WireFamily(f.name, f.type, f.help, f.unit, [])
        a = acc[f.name] = {}
        _sum_into(a, mine.samples)
        _sum_into(a, f.samples)
        mine.samples = list(a.values())
    return Snapshot(own.worker, list(fams.values()))


def merge(snapshots: list[Snapshot], me: int) -> list[Metric]:
    """One exposition out of every worker's snapshot; ``me``: the scraping worker (HOST gauges are its)."""
    order: list[str] = []
    by_name: dict[str, list[tuple[int, WireFamily]]] = {}
    for snap in sorted(snapshots, key=lambda x: x.worker):
        for f in snap.families:
            if f.name not in by_name:
                order.append(f.name)
                by_name[f.name] = []
            by_name[f.name].append((snap.worker, f))
    out = []
    for name in order:
        parts = by_name[name]
        first = parts[0][1]
        m = Metric(name, first.help, first.type, first.unit)
        policy = policy_of(name, first.type)
        if policy is Merge.SUM:
            acc: dict[_Key, WireSample] = {}
            for _, f in parts:
                _sum_into(acc, f.samples)
            chosen = list(acc.values())
        elif policy is Merge.WORKER:
            chosen = [
                WireSample(x.name, {**x.labels, "worker": x.labels.get("worker", str(w))}, x.value)
                for w, f in parts
                for x in f.samples
            ]
        else:
            want = me if policy is Merge.HOST else 0
            chosen = next((f.samples for w, f in parts if w == want), first.samples)
        for s in chosen:
            ex = s.exemplar
            m.add_sample(
                s.name,
                s.labels,
                s.value,
                exemplar=None if ex is None else Exemplar(ex.labels, ex.value, ex.timestamp),
            )
        out.append(m)
    return out


class Merged:
    """A registry-shaped view of merged families (what ``generate_latest`` reads)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


__all__ = ["Merge", "Merged", "Snapshot", "decode", "encode", "merge", "plus_base", "snapshot"]
