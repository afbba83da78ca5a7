"""Arrival processes: when each request of a workload is sent.

Open loop (times fixed in advance, whatever the fleet does)::

    AllAtOnce    ||||||||                      every request at ``at_s`` (SGLang's default: rate = inf)
    Poisson      | ||  |   | |||  |            exponential gaps at ``rate`` req/s
    Constant     |  |  |  |  |  |  |           evenly spaced at ``rate`` req/s
    Staged       | |  | ||||||||||||||||       a rate schedule (Poisson or constant within each stage)
    Bursts       ||||      ||||      ||||      ``size`` requests at once every ``interval_s``

Closed loop: ``ClosedLoop(concurrency)``: no times; the evaluator keeps ``concurrency`` requests in flight.

Trace times (Mooncake) are read from the file, see ``mooncake.py``.  Each spec is a tagged msgspec Struct
(``{"type": "poisson", "rate": 5}`` converts), dispatched with ``match``.
"""

from __future__ import annotations

import math

import msgspec
import numpy as np
from msgspec import Struct

from kvrouter.lab.workloads.spec import ArrivalMode, ClosedLoop, OpenLoop, Request, Workload


def _positive(name: str, value: float) -> None:
    if not value > 0 or math.isinf(value):
        raise ValueError(f"{name} must be a positive finite number, got {value}")


class AllAtOnce(Struct, frozen=True, tag="all-at-once", tag_field="type"):
    """Every request at the same instant."""

    at_s: float = 0.0
    """The instant, in seconds."""


class Poisson(Struct, frozen=True, tag="poisson", tag_field="type"):
    """A Poisson process."""

    rate: float
    """Mean requests per second."""

    def __post_init__(self) -> None:
        _positive("rate", self.rate)


class Constant(Struct, frozen=True, tag="constant", tag_field="type"):
    """Evenly spaced requests, the first at 0."""

    rate: float
    """Requests per second."""

    def __post_init__(self) -> None:
        _positive("rate", self.rate)


class Stage(Struct, frozen=True):
    """One step of a rate schedule."""

    rate: float
    """Requests per second during the stage."""
    duration_s: float
    """Length of the stage in seconds."""

    def __post_init__(self) -> None:
        _positive("rate", self.rate)
        _positive("duration_s", self.duration_s)


class Staged(Struct, frozen=True, tag="staged", tag_field="type"):
    """A rate schedule (inference-perf ``load.stages``); the number of requests follows from it."""

    stages: tuple[Stage, ...]
    """Consecutive stages."""
    poisson: bool = True
    """Poisson arrivals within each stage (inference-perf ``type: poisson``); False: evenly spaced."""

    def __post_init__(self) -> None:
        if not self.stages:
            raise ValueError("a staged schedule needs at least one stage")

    @property
    def duration_s(self) -> float:
        return sum(s.duration_s for s in self.stages)


class Bursts(Struct, frozen=True, tag="bursts", tag_field="type"):
    """``size`` requests at once, every ``interval_s`` (the Mooncake trace's ~3 s buckets, stylised)."""

    size: int
    """Requests per burst."""
    interval_s: float
    """Seconds between bursts."""

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"burst size must be >= 1, got {self.size}")
        _positive("interval_s", self.interval_s)


Arrival = AllAtOnce | Poisson | Constant | Staged | Bursts | ClosedLoop
"""Any arrival process a generator accepts."""


def arrival_times(arrival: Arrival, n: int | None, rng: np.random.Generator) -> list[float] | None:
    """Send times of ``n`` requests, ascending; None for closed loop.

    ``n`` may be None only for ``Staged``, whose schedule then decides the count; given, it caps it."""
    match arrival:
        case ClosedLoop():
            return None
        case Staged():
            times = _staged(arrival, rng)
            return times if n is None else times[:n]
    if n is None:
        raise ValueError(f"{type(arrival).__name__} arrivals need a request count")
    match arrival:
        case AllAtOnce(at_s=at):
            return [at] * n
        case Poisson(rate=rate):
            return np.cumsum(rng.exponential(1.0 / rate, n)).tolist()
        case Constant(rate=rate):
            return (np.arange(n) / rate).tolist()
        case Bursts(size=size, interval_s=interval):
            return ((np.arange(n) // size) * interval).astype(float).tolist()
    raise AssertionError(f"unhandled arrival {arrival!r}")


def _staged(arrival: Staged, rng: np.random.Generator) -> list[float]:
    times: list[float] = []
    t0 = 0.0
    for stage in arrival.stages:
        end = t0 + stage.duration_s
        if arrival.poisson:
            # Draw comfortably more gaps than the stage needs, then keep those inside it (memoryless).
            k = int(stage.rate * stage.duration_s + 6 * math.sqrt(stage.rate * stage.duration_s) + 10)
            ts = t0 + np.cumsum(rng.exponential(1.0 / stage.rate, k))
            while ts[-1] < end:
                ts = np.concatenate([ts, ts[-1] + np.cumsum(rng.exponential(1.0 / stage.rate, k))])
            times.extend(ts[ts < end].tolist())
        else:
            count = round(stage.rate * stage.duration_s)
            times.extend((t0 + np.arange(count) / stage.rate).tolist())
        t0 = end
    return times


def request_count(arrival: Arrival, num_requests: int | None, natural: int) -> int | None:
    """How many requests a generator should build: an explicit count, else the schedule's (``Staged``:
    None, decided by ``arrival_times``), else the workload's natural size (e.g. groups x prompts)."""
    if num_requests is not None:
        if num_requests < 0:
            raise ValueError(f"num_requests must be >= 0, got {num_requests}")
        return num_requests
    return None if isinstance(arrival, Staged) else natural


def mode_of(arrival: Arrival) -> ArrivalMode:
    return arrival if isinstance(arrival, ClosedLoop) else OpenLoop()


def scale_rate(workload: Workload, multiplier: float) -> Workload:
    """The same workload sent ``multiplier`` times faster (arrival times divided by it)."""
    _positive("multiplier", multiplier)
    if workload.closed_loop:
        return workload
    requests = [
        msgspec.structs.replace(r, arrival_s=None if r.arrival_s is None else r.arrival_s / multiplier)
        for r in workload.requests
    ]
    scaled = workload.metadata.get("rate_multiplier", 1.0) * multiplier
    meta = {**workload.metadata, "rate_multiplier": scaled}
    return msgspec.structs.replace(workload, requests=requests, metadata=meta)


def sort_requests(requests: list[Request]) -> list[Request]:
    """Release order: ascending arrival time, ties (and closed-loop requests) in generation order."""
    if any(r.arrival_s is None for r in requests):
        return requests
    return sorted(requests, key=lambda r: r.arrival_s or 0.0)
