"""A policy added from outside the routing package: one module's worth of code (its settings with their
declarations, its ranking, its reason) and one registry line (a field of a ``PolicySettings``), read
from a fleet file and routed with through the request pipeline, as every front door routes."""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec
import pytest
import yaml
from prometheus_client import CollectorRegistry

from indexer import Indexer
from indexer.config import ConfigError, parse_fleet
from kvrouter.config import RouterFleetConfig, RoutingConfig
from kvrouter.pipeline import PassThroughTokens, PipelineMetrics, RequestPipeline
from kvrouter.routing import Candidate, Router, Target
from kvrouter.routing.policies import PolicyConfig, PolicyContext, RouteView

# ---------------------------------------------------------------- the new policy: one file's worth

SHORTEST_QUEUE = "shortest-queue"


class ShortestQueueSettings(PolicyConfig, frozen=True):
    name: ClassVar[str] = SHORTEST_QUEUE

    decode_weight: float = 0.0
    """Queued prefill tokens one decoding request counts as."""

    def validate(self) -> None:
        if self.decode_weight < 0:
            raise ValueError("decode_weight must be >= 0")

    def build(self, context: PolicyContext) -> ShortestQueue:
        return ShortestQueue(self)


class ShortestQueue:
    """The target with the least queued prefill (plus ``decode_weight`` per decoding request)."""

    name = SHORTEST_QUEUE

    def __init__(self, settings: ShortestQueueSettings) -> None:
        self.settings = settings

    def rank(self, req: RouteView, cands: list[Candidate], *, dry_run: bool = False) -> list[Candidate]:
        for c in cands:
            c.score = c.pending_prefill_tokens + self.settings.decode_weight * c.decoding
        return sorted(cands, key=lambda c: (c.score, c.target))

    def reason(self, chosen: Candidate) -> str:
        return "queue"


class Routing(RoutingConfig, frozen=True):
    shortest_queue: ShortestQueueSettings = ShortestQueueSettings()  # the registry line


# ---------------------------------------------------------------- the fleet file and the front door


class Fleet(RouterFleetConfig, frozen=True, forbid_unknown_fields=True):
    routing: Routing = Routing()


FLEET = """
block_size: 16
instances:
  - {name: a, url: "http://127.0.0.1:1"}
  - {name: b, url: "http://127.0.0.1:2"}
  - {name: c, url: "http://127.0.0.1:3"}
routing:
  policy: shortest-queue
  shortest_queue: {decode_weight: 100}
  shadow_every: 1  # every decision shadow-scored (the default samples one in 16)
"""


class Targets:
    """The pipeline's view of the fleet: three healthy instances without events."""

    def targets(self, model: str | None) -> list[Target]:
        return [Target(n, has_events=False) for n in "abc"]

    def known_model(self, model: str | None) -> bool:
        return True

    def base_model(self, model: str | None) -> str | None:
        return None

    def instance_targets(self, name: str) -> list[Target] | None:
        return [Target(name, has_events=False)]


def pipeline(cfg: RouterFleetConfig) -> tuple[RequestPipeline, CollectorRegistry]:
    registry = CollectorRegistry()
    router = Router(Indexer(cfg.block_size), cfg.router_config())
    return RequestPipeline(cfg, router, Targets(), PassThroughTokens(), PipelineMetrics(registry)), registry


def body(n_tokens: int) -> bytes:
    return msgspec.json.encode({"model": "m", "prompt": list(range(1, n_tokens + 1)), "max_tokens": 1})


def read(doc: str, cls: type[RouterFleetConfig] = Fleet) -> Any:
    return parse_fleet(yaml.safe_load(doc), cls)


async def test_a_policy_from_one_module_routes_through_the_pipeline() -> None:
    cfg = read(FLEET)
    assert cfg.routing.shortest_queue == ShortestQueueSettings(decode_weight=100)
    pipe, registry = pipeline(cfg)
    # Reference: each target's queued prefill and decoding requests, as the policy should weigh them.
    queued = dict.fromkeys("abc", 0)
    decoding = dict.fromkeys("abc", 0)
    held = []
    for n_tokens in (400, 100, 50, 30, 300, 20):
        p = await pipe.prepare(body(n_tokens), "completions", {})
        d = await pipe.admit(p)
        assert d.chosen is not None
        want = min("abc", key=lambda t: (queued[t] + 100 * decoding[t], t))
        assert (d.policy, d.reason, d.chosen.target) == (SHORTEST_QUEUE, "queue", want)
        # every built-in policy is asked what it would have done; the active one is not
        assert sorted(pipe.router.shadow(d)) == sorted(
            [
                "kv-aware",
                "prefix-hash",
                "least-loaded",
                "round-robin",
                "random",
                "session",
                "predicted-latency",
            ]
        )
        pipe.dispatched(p, d.chosen)
        queued[want] += n_tokens
        held.append((p, d.chosen))
        if n_tokens == 100:  # the first request's prefill is done: it decodes now
            first, chosen = held[0]
            pipe.first_token(first)
            queued[chosen.target] -= 400
            decoding[chosen.target] += 1
    counted = registry.get_sample_value(
        "kvrouter_decisions_total", {"policy": SHORTEST_QUEUE, "reason": "queue"}
    )
    assert counted == 6


async def test_the_new_policy_is_scored_in_the_shadow_of_another() -> None:
    cfg = read(FLEET.replace("policy: shortest-queue", "policy: round-robin"))
    pipe, _ = pipeline(cfg)
    pipe.router.load.dispatch("r0", "a", 500)
    pipe.router.load.dispatch("r1", "b", 200)
    p = await pipe.prepare(body(64), "completions", {})
    d = await pipe.admit(p)
    assert d.policy == "round-robin"
    assert pipe.router.shadow(d)[SHORTEST_QUEUE].target == "c"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("shortest_queue: {decode_weight: -1}", "routing.shortest_queue.decode_weight must be >= 0"),
        ("shortest_queue: {decode_wieght: 1}", "routing.shortest_queue.decode_wieght"),
        ("policy: shortest-queu", "unknown policy 'shortest-queu'"),
    ],
)
def test_its_settings_are_checked_once_with_the_fleet_file(change: str, message: str) -> None:
    key = change.split(":")[0]
    doc = "\n".join(
        f"  {change}" if line.strip().startswith(f"{key}:") else line for line in FLEET.splitlines()
    )
    with pytest.raises(ConfigError, match=message):
        read(doc)


def test_a_router_without_the_registry_line_does_not_know_it() -> None:
    with pytest.raises(ConfigError, match="unknown policy 'shortest-queue'"):
        read(FLEET.replace("  shortest_queue: {decode_weight: 100}\n", ""), RouterFleetConfig)
