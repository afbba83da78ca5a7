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

    def figures(self, t: TargetKey) -> dict[str, int]:
        mine = [r for r in self.reqs.values() if r.target == t]
        prefilling = [r for r in mine if r.prefilling]
        running, waiting = self.engine.get(t, (0, 0))
        ext_n, ext_tokens = self.external.get(t, (0, 0))
        return {
            "in_flight": len(mine),
            "prefilling": len(prefilling),
            "pending_prefill_tokens": sum(r.tokens for r in prefilling),
            "decoding": len(mine) - len(prefilling),
            "engine_running": running,
            "engine_waiting": waiting,
            "external_in_flight": ext_n,
            "external_prefill_tokens": ext_tokens,
            "effective_in_flight": max(len(mine) + ext_n, running + waiting),
            "effective_pending_prefill_tokens": sum(r.tokens for r in prefilling) + ext_tokens,
        }
