"""predicted-latency through the request pipeline: kv-aware while any target's model is cold, then the
target with the lowest predicted TTFT as each target's observed times taught it (a slow instance loses
an equal-load tie it would win by name), within kv-aware's load bound; the predictions in explain and the
error and outcome metrics on the registry."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import yaml
from prometheus_client import CollectorRegistry

from indexer import Indexer
from indexer.config import parse_fleet
from kvrouter.config import RouterFleetConfig
from kvrouter.pipeline import PassThroughTokens, PipelineMetrics, Prepared, RequestPipeline, explain
from kvrouter.routing import Router, Target
from kvrouter.routing.policies import KvAware, KvAwareSettings, RouteView
from kvrouter.types import TargetKey

FLEET = """
block_size: 16
instances:
  - {name: a, url: "http://127.0.0.1:1"}
  - {name: b, url: "http://127.0.0.1:2"}
routing:
  policy: predicted-latency
  shadow: false
  predicted_latency: {model: {warmup: 4}}
"""


class Targets:
    def targets(self, model: str | None) -> list[Target]:
        return [Target(n, has_events=False) for n in "ab"]

    def known_model(self, model: str | None) -> bool:
        return True

    def base_model(self, model: str | None) -> str | None:
        return None

    def instance_targets(self, name: str) -> list[Target] | None:
        return [Target(name, has_events=False)]


def build(doc: str = FLEET) -> tuple[RequestPipeline, CollectorRegistry]:
    cfg: Any = parse_fleet(yaml.safe_load(doc), RouterFleetConfig)
    registry = CollectorRegistry()
    router = Router(Indexer(cfg.block_size), cfg.router_config())
    return RequestPipeline(cfg, router, Targets(), PassThroughTokens(), PipelineMetrics(registry)), registry


def body(n_tokens: int, start: int = 1) -> bytes:
    return msgspec.json.encode(
        {"model": "m", "prompt": list(range(start, start + n_tokens)), "max_tokens": 4}
    )


async def serve_one(pipe: RequestPipeline, n: int, start: int, slow: dict[str, float]) -> tuple[str, str]:
    """One request routed, dispatched, answered: its TTFT is ``slow[target]`` per 1k prompt tokens (a
    real wait on the monotonic clock the pipeline reads)."""
    p = await pipe.prepare(body(n, start), "completions", {})
    d = await pipe.admit(p)
    assert d.chosen is not None
    pipe.dispatched(p, d.chosen)
    await wait_at_least(slow[d.chosen.target] * n / 1000)
    pipe.first_token(p)
    pipe.finished(p, d.chosen, None)
    await asyncio.sleep(0)  # the scheduled training runs
    return d.chosen.target, d.reason


async def wait_at_least(s: float) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + s
    while loop.time() < end:
        await asyncio.sleep(end - loop.time())


async def test_cold_it_ranks_as_kv_aware_and_warm_it_prefers_the_faster_target() -> None:
    pipe, registry = build()
    slow = {"a": 0.06, "b": 0.012}  # a is five times slower per token
    seen: list[tuple[str, str]] = []
    for i in range(10):
        seen.append(await serve_one(pipe, 500, 1 + 1000 * i, slow))
    # cold: every choice is kv-aware's on the same candidates (idle fleet, no cache: its ring order)
    assert [r for _, r in seen[:4]] == ["cold"] * 4
    book = pipe.router.latency
    assert book.warm(TargetKey("a")) and book.warm(TargetKey("b"))
    # warm: the fast target every time at equal (zero) load
    warm = [await serve_one(pipe, 500, 50_000 + 1000 * i, slow) for i in range(4)]
    assert warm == [("b", "latency")] * 4
    p = await pipe.prepare(body(500, 99_000), "completions", {})
    d = pipe.decide(p, dry_run=True)
    pipe.router.predict(p.inp.num_tokens, d.ranked)
    out = explain(p, d, 0.0)
    pred = {c["target"]: c["predicted_ttft_s"] for c in out["candidates"]}
    assert pred["a"] > 2.5 * pred["b"] > 0
    assert registry.get_sample_value(
        "kvrouter_latency_observations_total", {"kind": "ttft", "outcome": "used"}
    )
    assert registry.get_sample_value("kvrouter_latency_prediction_error_ratio_count", {"kind": "ttft"})


async def test_cold_ranking_is_kv_aware_s() -> None:
    pipe, _ = build()
    pipe.router.load.dispatch("x", "a", 3000)
    p = await pipe.prepare(body(64), "completions", {})
    d = pipe.decide(p, dry_run=True)
    cands = pipe.router.candidates(p.inp, Targets().targets(None))
    want = KvAware(KvAwareSettings()).rank(RouteView(p.inp.num_tokens, p.inp.prefix_key), cands, dry_run=True)
    assert [c.target for c in d.ranked] == [c.target for c in want]


async def test_warm_it_stays_within_the_load_bound() -> None:
    pipe, _ = build(FLEET.replace("{warmup: 4}", "{warmup: 0}"))
    pipe.router.latency.model(TargetKey("a")).models["ttft"].set((0.01, 0.01, 0.0, 0.01, 0.0, 0.0, 0.0, 0.0))
    pipe.router.latency.model(TargetKey("b")).models["ttft"].set((1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0))
    held: list[tuple[Prepared, str]] = []
    for i in range(60):
        loads = {t: pipe.router.load.get(TargetKey(t)).in_flight for t in "ab"}
        over = loads["a"] > 1.5 * (loads["a"] + loads["b"]) / 2 + 8  # kv-aware's bound: 1.5 x mean + 8
        p = await pipe.prepare(body(32, 1 + 100 * i), "completions", {})
        d = await pipe.admit(p)
        assert d.chosen is not None
        assert (d.chosen.target, d.reason) == ("b" if over else "a", "latency")
        pipe.dispatched(p, d.chosen)
        held.append((p, d.chosen.target))
    # b is used though a is predicted a hundred times faster
    assert 0 < sum(t == "b" for _, t in held) < 30


async def test_it_keeps_kv_aware_s_choice_unless_the_models_tell_the_targets_apart_by_the_margin() -> None:
    """kv-aware prefers b (a has 3,000 tokens queued); the models predict a faster (the queue counts for
    nothing in them): by 10 %, inside the default margin (0.25), b is kept (reason ``deferred``); by 60 %,
    or with the margin off, a is chosen (``latency``)."""
    for margin, a_ttft, want in (
        (0.25, 0.09, ("b", "deferred")),
        (0.25, 0.04, ("a", "latency")),
        (0.0, 0.09, ("a", "latency")),
    ):
        doc = FLEET.replace("{warmup: 4}", "{warmup: 0}").replace(
            "predicted_latency: {", f"predicted_latency: {{defer_margin: {margin}, "
        )
        pipe, registry = build(doc)
        book = pipe.router.latency
        book.model(TargetKey("a")).models["ttft"].set((a_ttft, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0))
        book.model(TargetKey("b")).models["ttft"].set((0.1, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0))
        pipe.router.load.dispatch("x", "a", 3000)
        p = await pipe.prepare(body(64), "completions", {})
        cands = pipe.router.candidates(p.inp, Targets().targets(None))
        kv = KvAware(KvAwareSettings()).rank(
            RouteView(p.inp.num_tokens, p.inp.prefix_key), cands, dry_run=True
        )
        assert kv[0].target == "b"
        d = await pipe.admit(p)
        assert d.chosen is not None
        assert (d.chosen.target, d.reason) == want, (margin, a_ttft)
        pipe.dispatched(p, d.chosen)
        assert (
            registry.get_sample_value(
                "kvrouter_decisions_total", {"policy": "predicted-latency", "reason": want[1]}
            )
            == 1.0
        )
