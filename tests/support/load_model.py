"""A plain reference model of load accounting: the requests (target, tokens to prefill, past the first
token or not) and the last observations; every per-target figure the router reads is recomputed from them
from scratch.  ``routing.LoadTracker`` is held to it in one process and across a host's workers."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvrouter.types import TargetKey


@dataclass
class ModelReq:
    target: TargetKey
    tokens: int
    prefilling: bool = True


@dataclass
class LoadModel:
    reqs: dict[str, ModelReq] = field(default_factory=dict)
    engine: dict[TargetKey, tuple[int, int]] = field(default_factory=dict)
    external: dict[TargetKey, tuple[int, int]] = field(default_factory=dict)
    claims: dict[str, TargetKey] = field(default_factory=dict)
    """Capped slots taken by requests not dispatched yet: each counts in flight at its target."""

    def in_flight(self, t: TargetKey) -> int:
        return sum(r.target == t for r in self.reqs.values()) + sum(c == t for c in self.claims.values())

    def claim(self, rid: str, t: TargetKey, cap: int) -> bool:
        """A request's earlier claim is given back first; a slot is free below ``cap`` counting the
        external load."""
        self.claims.pop(rid, None)
        if self.in_flight(t) + self.external.get(t, (0, 0))[0] >= cap:
            return False
        self.claims[rid] = t
        return True

    def dispatch(self, rid: str, t: TargetKey, tokens: int) -> None:
        self.claims.pop(rid, None)  # taken there, or given back when the request went elsewhere
        self.reqs[rid] = ModelReq(t, tokens)  # a re-sent id replaces its earlier dispatch

    def finish(self, rid: str) -> None:
        self.claims.pop(rid, None)
        self.reqs.pop(rid, None)

    def forget(self, t: TargetKey) -> None:
        self.reqs = {k: r for k, r in self.reqs.items() if r.target != t}
        self.claims = {k: c for k, c in self.claims.items() if c != t}
        self.engine.pop(t, None)
        self.external.pop(t, None)

    def total_in_flight(self) -> int:
        return len(self.reqs) + len(self.claims)

    def figures(self, t: TargetKey) -> dict[str, int]:
        mine = [r for r in self.reqs.values() if r.target == t]
        prefilling = [r for r in mine if r.prefilling]
        running, waiting = self.engine.get(t, (0, 0))
        ext_n, ext_tokens = self.external.get(t, (0, 0))
        n = self.in_flight(t)
        return {
            "in_flight": n,
            "prefilling": len(prefilling),
            "pending_prefill_tokens": sum(r.tokens for r in prefilling),
            "decoding": len(mine) - len(prefilling),
            "engine_running": running,
            "engine_waiting": waiting,
            "external_in_flight": ext_n,
            "external_prefill_tokens": ext_tokens,
            "effective_in_flight": max(n + ext_n, running + waiting),
            "effective_pending_prefill_tokens": sum(r.tokens for r in prefilling) + ext_tokens,
        }
