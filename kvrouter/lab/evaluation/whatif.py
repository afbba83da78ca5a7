"""The floor under any latency predictor: what-if runs of the simulated engines at dispatch.

For a request about to be placed and a candidate instance, a copy of that instance's engine and API server
is taken as they are now, with the requests already on their way there; the request is added when it
would arrive, and the copy is stepped until it gives the request's first token.  That TTFT is what the
simulator itself would answer from everything known at dispatch; what it cannot know is the requests
that arrive later and share the request's steps.  Two modes::

    learned  the shipped predicted-latency policy; the what-if is computed beside it (its error is the
             floor of any predictor on the same requests)
    oracle   predicted-latency ranked by the what-if TTFTs (every candidate warm): the best a greedy
             choice by predicted TTFT can do

    python -m kvrouter.lab.evaluation.whatif RATE learned|oracle [--defer-margin M] [--limit N]
                                             [--recompute-weight W]

Costs 60-90 ms per candidate (deep copies), so minutes per 1,200 requests.  Figures: docs/measurements.md,
"The floor under any predictor".
"""

from __future__ import annotations

import argparse
import copy
import statistics
from collections.abc import Callable
from typing import Any

import msgspec

from kvrouter.lab.evaluation.compare import EvalSpec, _router_config, load_workload, summarize
from kvrouter.lab.evaluation.virtual_fleet import FleetSimConfig, VirtualFleet
from kvrouter.lab.sim.engine.engine import StepResult
from kvrouter.lab.workloads.blocks import BlockContentCache
from kvrouter.lab.workloads.tokens import prompt_tokens
from kvrouter.routing.policies import Candidate, PolicySettings

MIXED = ["llama-3.1-70b-8xh100"] * 2 + ["llama-3.1-70b-8xa100"] * 2


class WhatIf:
    """A VirtualFleet instrumented to answer what-if TTFTs: when each engine's current step ends, and the
    requests on their way to it (dispatched, not yet added)."""

    def __init__(self, vf: VirtualFleet) -> None:
        self.vf = vf
        self.step_end = [0.0] * len(vf.engines)
        self.pending: list[dict[str, float]] = [{} for _ in vf.engines]
        self.current: str | None = None
        self.predicted: dict[tuple[str, str], float] = {}
        self._arrival = 0.0
        for i, eng in enumerate(vf.engines):
            eng.step_many = self._timed(i, eng.step_many)  # type: ignore[method-assign,assignment]
        for fe in vf.frontends:
            fe.arrive = self._noted(fe.arrive)  # type: ignore[method-assign]
        to_engine, engine_add, try_route = vf._to_engine, vf._engine_add, vf._try_route

        def on_to_engine(i: int, rid: str, now: float, **kw: bool) -> None:
            to_engine(i, rid, now, **kw)
            self.pending[i][rid] = self._arrival

        def on_engine_add(i: int, rid: str, **kw: bool) -> None:
            self.pending[i].pop(rid, None)
            engine_add(i, rid, **kw)

        def on_try_route(rid: str, *, queue_if_full: bool) -> bool:
            self.current = rid
            return try_route(rid, queue_if_full=queue_if_full)

        vf._to_engine = on_to_engine  # type: ignore[method-assign]
        vf._engine_add = on_engine_add  # type: ignore[method-assign]
        vf._try_route = on_try_route  # type: ignore[method-assign]

    def _timed(
        self, i: int, step_many: Callable[[int, float], StepResult]
    ) -> Callable[[int, float], StepResult]:
        def run(max_steps: int, max_duration_s: float) -> StepResult:
            res = step_many(max_steps, max_duration_s)
            self.step_end[i] = self.vf.clock.now + res.duration_s
            return res

        return run

    def _noted(self, arrive: Callable[..., float]) -> Callable[..., float]:
        def run(*a: Any, **k: Any) -> float:
            self._arrival = arrive(*a, **k)
            return self._arrival

        return run

    def ttft(self, rid: str, instance: str) -> float:
        """``rid``'s TTFT from now if placed at ``instance`` now, later arrivals aside."""
        vf = self.vf
        i, r, now = vf.index[instance], vf.by_id[rid], vf.clock.now
        fe = copy.deepcopy(vf.frontends[i])
        # (the class's arrive: the copy's own attribute is the wrapper noting the original's arrivals)
        at_engine = type(fe).arrive(fe, now + vf.cfg.net_latency_s, r.num_prompt_tokens, vf._api(r))
        eng = copy.deepcopy(vf.engines[i])
        t = self.step_end[i] if vf.busy[i] and self.step_end[i] > now else now
        for ta, x in [*sorted((ta, x) for x, ta in self.pending[i].items()), (at_engine, rid)]:
            while t < ta and eng.has_work():
                res = eng.step()
                if not (res.num_scheduled or res.loaded_tokens):
                    break
                t += res.duration_s
            t = max(t, ta)
            rx = vf.by_id[x]
            space = vf.workload.token_space
            eng.add_request(x, prompt_tokens(rx, space), rx.max_output_tokens, cache_salt=rx.cache_salt)
        while True:
            res = eng.step()
            t += res.duration_s
            if any(o.request_id == rid and o.first_token for o in res.outputs):
                break
            if not (res.num_scheduled or res.loaded_tokens or eng.has_work()):
                raise RuntimeError(f"the what-if run of {rid} at {instance} stopped without its first token")
        out = t + vf.cfg.net_latency_s + fe.first_output_delay(r.num_prompt_tokens) - now
        self.predicted[(rid, instance)] = out
        return out


def run(
    rate: float, mode: str, *, defer_margin: float = 0.25, limit: int = 1200, recompute_weight: float = 1.0
) -> dict[str, Any]:
    """One run of the mixed fleet on ``mooncake-conversation``: the summary, and the what-if's MAPE over
    the requests as placed (TTFT from dispatch)."""
    if mode not in ("learned", "oracle"):
        raise ValueError("mode is learned or oracle")
    st = PolicySettings()
    pl = msgspec.structs.replace(
        st.predicted_latency, defer_margin=defer_margin, recompute_weight=recompute_weight
    )
    spec = EvalSpec(
        workload="mooncake-conversation",
        overrides={"limit": limit, "rate_multiplier": rate},
        fleet=FleetSimConfig(instances=len(MIXED), profiles=MIXED),
        settings=msgspec.structs.replace(st, predicted_latency=pl),
    )
    w = load_workload(spec)
    cache = BlockContentCache(w.token_space, spec.fleet.block_size)
    cache.warm(w.requests)
    vf = VirtualFleet(w, spec.fleet, _router_config(spec, "predicted-latency"), hashes=cache)
    wi = WhatIf(vf)
    book = vf.router.latency
    learned = book.predict

    def predict(n: int, c: Candidate) -> tuple[float, float]:
        ttft, tpot = learned(n, c)
        if wi.current is None:
            return ttft, tpot
        o = wi.ttft(wi.current, c.instance)
        return (o if mode == "oracle" else ttft), tpot

    book.predict = predict  # type: ignore[method-assign,assignment]
    if mode == "oracle":
        book.warm = lambda target: True  # type: ignore[method-assign]
    fleet_run = vf.run()
    rel = []  # (what-if - observed) / observed, per request as placed
    for rec in fleet_run.records:
        p = wi.predicted.get((rec.id, rec.instance or ""))
        if p is not None and rec.first_token_s is not None and rec.dispatch_s is not None:
            actual = rec.first_token_s - rec.dispatch_s
            rel.append((p - actual) / actual)
    res = summarize(fleet_run)
    res["whatif_mape"] = statistics.fmean(abs(e) for e in rel) if rel else float("nan")
    res["whatif_n"] = len(rel)
    res["whatif_exact"] = sum(abs(e) < 1e-6 for e in rel) / len(rel) if rel else 0.0
    """Requests whose what-if was their TTFT exactly (nothing arrived after them to share their steps)."""
    res["whatif_over"] = sum(e > 1e-6 for e in rel) / len(rel) if rel else 0.0
    res["learned_mape"] = book.errors["ttft"].mape or float("nan")  # (None: never warm)
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("rate", type=float, help="the trace's rate multiplier (0.33: 1x load, 1.0: 3x)")
    p.add_argument("mode", choices=("learned", "oracle"))
    p.add_argument("--defer-margin", type=float, default=0.25)
    p.add_argument("--limit", type=int, default=1200)
    p.add_argument("--recompute-weight", type=float, default=1.0)
    a = p.parse_args()
    r = run(a.rate, a.mode, defer_margin=a.defer_margin, limit=a.limit, recompute_weight=a.recompute_weight)
    print(
        f"rate {a.rate} {a.mode} defer_margin {a.defer_margin}: TTFT mean {r['ttft_mean_s']:.3f} s, p90 "
        f"{r['ttft_p90_s']:.3f} s, hit {r['hit_rate']:.3f}; what-if MAPE {r['whatif_mape']:.3f} over "
        f"{r['whatif_n']} requests (exact {r['whatif_exact']:.2f}, over {r['whatif_over']:.2f}); the learned "
        f"models' MAPE {r['learned_mape']:.3f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
