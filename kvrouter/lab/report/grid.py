"""Grids of evaluations: many (case, policy) runs of ``kvrouter eval`` in one process pool.

Each ``Case(label, x, spec)`` gives a task per policy plus its two bounds (pooled cache, reuse ceiling);
the result per case has the shape ``evaluate`` returns (``label``, ``x``, ``workload``, ``bounds``,
``policies``...), so ``evaluation.table`` reads it.  Every run of every case is one task of a single pool,
where ``evaluate`` would start a pool per call (each worker imports numba, the indexer and the engine)
and leave a core idle on an odd number of runs.  Each run is exactly ``run_one``: the same engine model,
Router and Indexer as ``kvrouter eval``.

Sweeps change one parameter of a base spec, named by a dotted path (``fleet.instances``,
``settings.prefix_hash.load_bound``, ``overrides.system_len``) or ``rate`` (arrivals ``x`` times faster).
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from typing import Any

import msgspec

from kvrouter.lab.evaluation.compare import EvalSpec, load_workload, run_one
from kvrouter.lab.workloads.arrivals import AllAtOnce, Arrival, Bursts, Constant, Poisson, Stage, Staged
from kvrouter.lab.workloads.bounds import reuse_ceiling
from kvrouter.lab.workloads.registry import workload_params
from kvrouter.lab.workloads.spec import ClosedLoop
from kvrouter.routing import policy_name

POOLED = "pooled-cache"
REUSE = "reuse-ceiling"
Result = dict[str, Any]


class Case(msgspec.Struct, frozen=True):
    """One point of a grid: a spec (its ``policies`` are the runs) with a label and a sweep value."""

    label: str
    """Shown in tables and legends (e.g. the workload's name, or ``instances=4``)."""
    spec: EvalSpec
    x: float | int | str | None = None
    """The swept value (None outside sweeps)."""
    bounds: bool = True
    """Also run the pooled-cache bound and compute the reuse ceiling."""


# ---------------------------------------------------------------------------------------------- changing
def with_param(spec: EvalSpec, path: str, value: Any) -> EvalSpec:
    """``spec`` with the field at dotted ``path`` set to ``value``; ``overrides.<name>`` sets a workload
    parameter, ``rate`` multiplies the arrival rate (see ``with_rate``)."""
    if path == "rate":
        return with_rate(spec, float(value))
    head, _, rest = path.partition(".")
    if head == "overrides":
        if not rest:
            raise ValueError("overrides needs a parameter name: overrides.<name>")
        return msgspec.structs.replace(spec, overrides={**spec.overrides, rest: value})
    return _set(spec, path.split("."), value)


def _set(obj: Any, names: list[str], value: Any) -> Any:
    if not isinstance(obj, msgspec.Struct) or names[0] not in obj.__struct_fields__:
        raise ValueError(f"no field {names[0]!r} in {type(obj).__name__}")
    if len(names) == 1:
        return msgspec.structs.replace(obj, **{names[0]: value})
    return msgspec.structs.replace(obj, **{names[0]: _set(getattr(obj, names[0]), names[1:], value)})


def scale_arrival(arrival: Arrival, m: float) -> Arrival:
    """The arrival process ``m`` times as fast (the same requests in ``1/m`` of the time); closed loop
    gets ``m`` times the clients."""
    if not m > 0 or math.isinf(m):
        raise ValueError(f"rate multiplier must be positive and finite, got {m}")
    match arrival:
        case Poisson(rate=r):
            return Poisson(r * m)
        case Constant(rate=r):
            return Constant(r * m)
        case Staged(stages=stages, poisson=poisson):
            return Staged(tuple(Stage(s.rate * m, s.duration_s / m) for s in stages), poisson=poisson)
        case Bursts(size=size, interval_s=interval):
            return Bursts(size, interval / m)
        case ClosedLoop(concurrency=c):
            return ClosedLoop(max(1, round(c * m)))
        case AllAtOnce():
            return arrival
    raise AssertionError(f"unhandled arrival {arrival!r}")


def with_rate(spec: EvalSpec, m: float) -> EvalSpec:
    """``spec`` with its workload sent ``m`` times faster: a trace's ``rate_multiplier`` is multiplied, a
    generator's arrival process scaled (``scale_arrival``)."""
    if spec.workload is None:
        raise ValueError("with_rate needs a named workload (use workload='mooncake-conversation', not trace)")
    params = workload_params(spec.workload, **spec.overrides)
    if hasattr(params, "rate_multiplier"):
        return with_param(spec, "overrides.rate_multiplier", params.rate_multiplier * m)
    arrival = scale_arrival(params.arrival, m)  # type: ignore[attr-defined]
    return with_param(spec, "overrides.arrival", msgspec.to_builtins(arrival))


def sweep(
    base: EvalSpec,
    path: str,
    values: Iterable[Any],
    *,
    label: str | None = None,
    bounds: bool = False,
) -> list[Case]:
    """One case per value of the parameter at ``path`` (see ``with_param``)."""
    name = label or path.rsplit(".", 1)[-1]
    return [Case(f"{name}={v}", with_param(base, path, v), v, bounds) for v in values]


# ---------------------------------------------------------------------------------------------- running
def _task(spec_bytes: bytes, what: str) -> Result:
    spec = msgspec.json.decode(spec_bytes, type=EvalSpec)
    if what == REUSE:
        w = load_workload(spec)
        return {"hit_rate": reuse_ceiling(w, spec.fleet.block_size), "requests": len(w.requests)}
    return run_one(spec, what)


def _tasks(cases: Sequence[Case]) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    for i, c in enumerate(cases):
        for p in c.spec.policies:
            try:
                policy_name(p)
            except ValueError as e:
                raise ValueError(f"{c.label}: {e}") from None
        out.extend((i, p) for p in c.spec.policies)
        if c.bounds:
            out.extend([(i, POOLED), (i, REUSE)])
    return out


def _assemble(cases: Sequence[Case], done: dict[tuple[int, str], Result]) -> list[Result]:
    results = []
    for i, c in enumerate(cases):
        runs = {p: done[(i, p)] for p in c.spec.policies}
        first = next(iter(runs.values()), {})
        bounds: dict[str, Any] = {}
        if c.bounds:
            pooled = done[(i, POOLED)]
            bounds = {
                "reuse_ceiling": done[(i, REUSE)]["hit_rate"],
                "pooled_cache": pooled["hit_rate"],
                "pooled_cache_run": pooled,
            }
        results.append(
            {
                "label": c.label,
                "x": c.x,
                "workload": c.spec.workload or c.spec.trace,
                "requests": first.get("requests", 0),
                "instances": c.spec.fleet.instances,
                "fleet": msgspec.to_builtins(c.spec.fleet),
                "bounds": bounds,
                "policies": runs,
            }
        )
    return results


def run_grid(
    cases: Sequence[Case],
    *,
    jobs: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[Result]:
    """Every run of every case; results in case order.  ``jobs=1`` runs in this process (no pool).
    ``progress(done, total)`` is called after each run."""
    tasks = _tasks(cases)
    blobs = [msgspec.json.encode(c.spec) for c in cases]
    done: dict[tuple[int, str], Result] = {}
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(tasks) or 1))
    if jobs == 1:
        for k, (i, what) in enumerate(tasks, 1):
            done[(i, what)] = _task(blobs[i], what)
            if progress:
                progress(k, len(tasks))
        return _assemble(cases, done)
    # spawn: workers must not inherit a Jupyter kernel's or a test's threads and sockets.
    with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as pool:
        futs: dict[Future[Result], tuple[int, str]] = {
            pool.submit(_task, blobs[i], what): (i, what) for i, what in tasks
        }
        pending = set(futs)
        while pending:
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for f in finished:
                done[futs[f]] = f.result()
            if progress:
                progress(len(done), len(tasks))
    return _assemble(cases, done)
