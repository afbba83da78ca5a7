"""Load accounting per instance: what the router has sent and not yet seen finish.

A request is dispatched (``pending_prefill`` += tokens to compute), prefills until its first token
(``pending_prefill`` -= them), then decodes until it finishes or fails (``decoding`` -= 1).

The router's own view is exact for its own requests; the engines' ``/metrics`` add what other routers or
clients put there (``observe_engine``).  ``load()`` takes the higher of the two (the engine's: other
traffic; the router's: the scrape is stale).  With several replicas, ``set_external`` adds what the
others have in flight here (``kvrouter.replicas``).  With ``serve --workers N``, every count lives in
memory the workers share (``SharedLoads``, from ``kvrouter.host``): each tracker writes its own
process's requests to its own row and reads the host's totals on ``refresh``, so every worker decides on
the whole host's load.  Without ``shared`` the tracker is in-process.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

import msgspec

from ..types import RequestId, TargetKey


class InstanceLoad(msgspec.Struct):
    """Load of one instance as the router sees it."""

    in_flight: int = 0
    """Requests sent and not finished."""
    prefilling: int = 0
    """Requests sent that have not produced their first token."""
    pending_prefill_tokens: int = 0
    """Prompt tokens still to compute (prompt minus predicted cached) of requests not yet past prefill."""
    decoding: int = 0
    """Requests past their first token, still generating."""
    engine_running: int = 0
    """From the engine's /metrics: vllm:num_requests_running (0 when unknown)."""
    engine_waiting: int = 0
    """From the engine's /metrics: vllm:num_requests_waiting."""
    engine_kv_usage: float = 0.0
    """From the engine's /metrics: vllm:kv_cache_usage_perc (0-1; 0 when unknown)."""
    external_in_flight: int = 0
    """Requests other router replicas have in flight here (shared router state; 0 with one router)."""
    external_prefill_tokens: int = 0
    """Prompt tokens other router replicas sent here that are still to prefill (shared router state)."""

    def effective_in_flight(self) -> int:
        return max(self.in_flight + self.external_in_flight, self.engine_running + self.engine_waiting)

    def effective_pending_prefill_tokens(self) -> int:
        return self.pending_prefill_tokens + self.external_prefill_tokens


class _Req(msgspec.Struct):
    instance: TargetKey
    prefill_tokens: int
    prefilling: bool = True


class SharedLoads(Protocol):
    """Load counts shared by the worker processes of one host: one row per worker, shared engine and
    external cells, keyed by slots every worker agrees on (``kvrouter.host.HostLoads``)."""

    def slot(self, key: TargetKey) -> int: ...

    def slots(self) -> list[tuple[TargetKey, int]]:
        """Every target any worker has a slot for, with its slot."""

    def add(self, slot: int, in_flight: int, prefilling: int, prefill_tokens: int, decoding: int) -> None:
        """Add to this worker's own row."""

    def claim(self, slot: int, cap: int) -> bool:
        """Atomically for the host: if every worker's in-flight requests plus the external ones at
        ``slot`` are below ``cap``, count one more in this worker's row and say True."""

    def read(self, slots: list[int]) -> list[tuple[list[int], list[float], list[int]]]:
        """Per slot: the summed counts, the engine's [running, waiting, seen_at (0: never)] and the
        external [in flight, prefill tokens]."""

    def set_engine(
        self, slot: int, running: int, waiting: int, seen_at: float, kv_usage: float = 0.0
    ) -> None: ...

    def set_external(self, slot: int, in_flight: int, prefill_tokens: int) -> None: ...


class LoadTracker:
    """Per-instance load, updated by the router's own dispatches and by engine metrics."""

    def __init__(self, shared: SharedLoads | None = None) -> None:
        self.loads: dict[TargetKey, InstanceLoad] = {}
        self._reqs: dict[RequestId, _Req] = {}
        self.shared = shared
        self._slots: dict[TargetKey, int] = {}
        self._claims: dict[RequestId, TargetKey] = {}
        """Requests holding one of a target's capped slots (counted in ``in_flight``), not dispatched yet."""

    def _slot(self, inst: TargetKey) -> int:
        s = self._slots.get(inst)
        if s is None:
            assert self.shared is not None
            s = self._slots[inst] = self.shared.slot(inst)
        return s

    def refresh(self, keys: Iterable[TargetKey] | None = None) -> None:
        """Read the host's totals (every worker's requests, the shared engine and external load) into
        ``loads`` for ``keys`` (None: every target the host knows).  Without ``shared``: nothing to do."""
        sh = self.shared
        if sh is None:
            return
        pairs = sh.slots() if keys is None else [(k, self._slot(k)) for k in keys]
        if not pairs:
            return
        rows = sh.read([s for _, s in pairs])
        for (key, _), (counts, eng, ext) in zip(pairs, rows, strict=True):
            load = self.get(key)
            load.in_flight, load.prefilling, load.pending_prefill_tokens, load.decoding = counts
            load.engine_running, load.engine_waiting = int(eng[0]), int(eng[1])
            load.engine_kv_usage = float(eng[3])
            load.external_in_flight, load.external_prefill_tokens = ext

    def get(self, inst: TargetKey) -> InstanceLoad:
        load = self.loads.get(inst)
        if load is None:
            load = self.loads[inst] = InstanceLoad()
        return load

    def claim(self, rid: RequestId, inst: TargetKey, cap: int) -> bool:
        """Take one of ``inst``'s ``cap`` request slots for ``rid``, whose ``dispatch`` there follows (or
        ``finish`` gives it back); False when they are all taken.  One process decides and dispatches
        without yielding, so the decision's own check holds; worker processes of one host decide at the
        same time, and only this check, made under the host's lock, keeps their sum within ``cap``."""
        self.unclaim(rid)
        load = self.get(inst)
        if self.shared is not None:
            if not self.shared.claim(self._slot(inst), cap):
                return False
        elif load.in_flight + load.external_in_flight >= cap:
            return False
        load.in_flight += 1
        self._claims[rid] = inst
        return True

    def unclaim(self, rid: RequestId) -> None:
        """``rid`` gives back the slot it claimed, if it holds one."""
        inst = self._claims.pop(rid, None)
        if inst is None:
            return
        self.get(inst).in_flight -= 1
        if self.shared is not None:
            self.shared.add(self._slot(inst), -1, 0, 0, 0)

    def dispatch(self, rid: RequestId, inst: TargetKey, prefill_tokens: int) -> None:
        """A request was sent to ``inst``; ``prefill_tokens`` is what it must compute (not cached).  A slot
        ``rid`` claimed there is the one it takes (already counted in flight)."""
        claimed = self._claims.get(rid) == inst
        if claimed:
            del self._claims[rid]
        else:
            self.unclaim(rid)
        self._release(rid)
        self._reqs[rid] = _Req(inst, prefill_tokens)
        load = self.get(inst)
        new = 0 if claimed else 1
        load.in_flight += new
        load.prefilling += 1
        load.pending_prefill_tokens += prefill_tokens
        if self.shared is not None:
            self.shared.add(self._slot(inst), new, 1, prefill_tokens, 0)

    def first_token(self, rid: RequestId) -> None:
        r = self._reqs.get(rid)
        if r is None or not r.prefilling:
            return
        r.prefilling = False
        load = self.get(r.instance)
        load.prefilling -= 1
        load.pending_prefill_tokens -= r.prefill_tokens
        load.decoding += 1
        if self.shared is not None:
            self.shared.add(self._slot(r.instance), 0, -1, -r.prefill_tokens, 1)

    def finish(self, rid: RequestId) -> None:
        """Finished, failed or cancelled: the request no longer loads its instance (nor holds a claim)."""
        self.unclaim(rid)
        self._release(rid)

    def _release(self, rid: RequestId) -> None:
        """The dispatched request's load goes (a claim it holds for a retry elsewhere stays)."""
        r = self._reqs.pop(rid, None)
        if r is None:
            return
        load = self.get(r.instance)
        load.in_flight -= 1
        if r.prefilling:
            load.prefilling -= 1
            load.pending_prefill_tokens -= r.prefill_tokens
        else:
            load.decoding -= 1
        if self.shared is not None:
            pre = int(r.prefilling)
            self.shared.add(self._slot(r.instance), -1, -pre, -r.prefill_tokens * pre, pre - 1)

    def observe_engine(
        self, inst: TargetKey, running: int, waiting: int, now: float, kv_usage: float = 0.0
    ) -> None:
        load = self.get(inst)
        load.engine_running, load.engine_waiting, load.engine_kv_usage = running, waiting, kv_usage
        if self.shared is not None:
            self.shared.set_engine(self._slot(inst), running, waiting, now, kv_usage)

    def set_external(self, loads: Mapping[TargetKey, tuple[int, int]]) -> None:
        """Other replicas' (in flight, prefill tokens) per instance; instances absent here get zero."""
        for inst, load in self.loads.items():
            if inst not in loads:
                load.external_in_flight = load.external_prefill_tokens = 0
        for inst, (n, tokens) in loads.items():
            load = self.get(inst)
            load.external_in_flight, load.external_prefill_tokens = n, tokens
        if self.shared is not None:
            for key, slot in self.shared.slots():
                self.shared.set_external(slot, *loads.get(key, (0, 0)))
            for key in loads:
                self.shared.set_external(self._slot(key), *loads[key])

    def instance_of(self, rid: RequestId) -> TargetKey | None:
        r = self._reqs.get(rid)
        return None if r is None else r.instance

    def total_in_flight(self) -> int:
        return sum(load.in_flight for load in self.loads.values())

    def forget(self, inst: TargetKey) -> None:
        """``inst`` left the fleet: this process's requests there no longer count (with shared loads, other
        workers forget theirs when they see it leave)."""
        for rid in [r for r, v in self._reqs.items() if v.instance == inst]:
            self._release(rid)
        for rid in [r for r, i in self._claims.items() if i == inst]:
            self.unclaim(rid)
        self.loads.pop(inst, None)
        if self.shared is not None:
            slot = self._slot(inst)
            self.shared.set_engine(slot, 0, 0, 0.0)
            self.shared.set_external(slot, 0, 0)
