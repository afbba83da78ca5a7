"""Routing-decision time for an 8k-token chat prompt, as the gateway computes it per request:
render the chat template, tokenize with a warm tokenizer cache, hash the blocks, look them up in the
index, score every candidate.  The index holds the fleet's state (8 instances; the system prompt cached
on one of them) so the lookup walks a real match.

Reported: p50/p99 of the whole decision and of each stage, sync (one thread) and through the async path
the gateway uses (tokenization on the tokenizer cache's thread pool).  Shadow scoring (what the other
policies would have chosen) runs after the decision, as in the gateway, once the request is on its way
upstream; its time is reported on its own (``shadow_after_dispatch``), not in the decision's.

``rank_per_candidate``: one policy's ranking alone (``Policy.rank`` over candidates already built), per
candidate, for kv-aware and predicted-latency (its every target's latency model warm) at 8 and 64
candidates, in the same run: what predicting TTFT and TPOT adds to a decision.

``flow_lanes_per_request``: with ``limits.isolation`` on, reading a request's lanes (heavy, quiet open)
from the work meter and charging it, per request, with 10, 1,000 and 10,000 tenants metered (a router has
one per API key): the cost must not grow with them (``target_lanes_flat_in_tenants``: 10,000 within 2x
of 10).

``flow_accounts``: the memory a queue's flow accounts hold after 20,000 and 200,000 one-off tenants
(``flows.max_flows`` 10,000, and unbounded as the reference, in the same run), and the time per charge:
bounded, it must not grow with them (``target_accounts_flat_in_tenants``: within 1.1x).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import threading
import time
import tracemalloc
from typing import Any

import msgspec

from indexer import Indexer, SourceKey
from indexer.encode import PayloadEncoder
from indexer.hashing import TokenIds, request_chains
from kvrouter.api.requests import prefix_text
from kvrouter.flows import Flow, FlowQueue, WorkMeter
from kvrouter.host.latency import HostLatency
from kvrouter.host.memory import HostLayout, HostMemory
from kvrouter.lab.sim.server.tokenizer import SIM_CHAT_TEMPLATE
from kvrouter.lab.workloads.text import WORDS
from kvrouter.percentiles import summary_us
from kvrouter.routing import RouteInput, Router, route_input
from kvrouter.routing.isolation import Isolation
from kvrouter.routing.policies import (
    KV_AWARE,
    PREDICTED_LATENCY,
    Candidate,
    PrefixHashSettings,
    RouteView,
)
from kvrouter.routing.router import Target
from kvrouter.types import InstanceId, RequestId, TargetKey
from tokenizer_cache import CachedTokenizer, Encoded, chat_body, default_tokenizer_path


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _as_gateway_hashes_them(res: Encoded) -> TokenIds:
    """What ``FleetTokens.tokens`` hands the gateway: the cache's uint32 array when it had one."""
    return res.tokens if res.array is None else res.array


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--system-words", type=int, default=8000, help="~8k tokens with the default tokenizer")
    ap.add_argument("--question-words", type=int, default=60)
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--seed", type=int, default=3)


def main(a: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(a.seed)
    tok = CachedTokenizer.from_pretrained(default_tokenizer_path(), chat_template=SIM_CHAT_TEMPLATE)
    system = _words(rng, a.system_words)
    ix = Indexer(16)
    router = Router(ix)
    targets = [Target(InstanceId(f"vllm-{i}")) for i in range(a.instances)]
    enc = PayloadEncoder()
    # the system prompt (and an earlier question) cached on vllm-3, as its events would say
    warm_msgs = [{"role": "system", "content": system}, {"role": "user", "content": "warm up"}]
    warm = tok.encode_chat_request(chat_body(warm_msgs)).tokens
    n = len(warm) // 16
    ix.apply_payload(
        "vllm-3", enc.batch([enc.stored(list(range(1, n + 1)), None, warm[: n * 16], 16)], ts=1.0)
    )
    for t in targets:
        ix.register(SourceKey(t.instance, 0))
    stages: dict[str, list[float]] = {
        k: [] for k in ("render_tokenize", "hash", "lookup_score", "total", "shadow_after_dispatch")
    }

    def route_input_of(i: str, ids: TokenIds, msgs: list[dict[str, str]]) -> RouteInput:
        """As the gateway builds it (``route_input``): chains in the request's namespace, the prefix key."""
        return route_input(
            RequestId(i),
            chains=request_chains(ids, 16),
            num_tokens=len(ids),
            prefix_text=prefix_text(msgs),
            affinity=None,
            model=None,
            prefix_length=PrefixHashSettings().prefix_length,
        )

    chosen = set()
    for i in range(a.iters):
        msgs = [
            {"role": "system", "content": system},
            {"role": "user", "content": _words(rng, a.question_words)},
        ]
        t0 = time.perf_counter()
        ids = _as_gateway_hashes_them(tok.encode_chat_request(chat_body(msgs)))
        t1 = time.perf_counter()
        inp = route_input_of(str(i), ids, msgs)
        t2 = time.perf_counter()
        d = router.route(inp, targets, now=float(i), shadow=False)
        t3 = time.perf_counter()
        assert d.chosen is not None
        chosen.add(d.chosen.instance)
        router.shadow(d)  # as the gateway does once the request is on its way: off the decision's path
        t4 = time.perf_counter()
        for k, v in (
            ("render_tokenize", t1 - t0),
            ("hash", t2 - t1),
            ("lookup_score", t3 - t2),
            ("total", t3 - t0),
            ("shadow_after_dispatch", t4 - t3),
        ):
            stages[k].append(v)

    async def async_path() -> list[float]:
        out = []
        for i in range(a.iters):
            msgs = [
                {"role": "system", "content": system},
                {"role": "user", "content": _words(rng, a.question_words)},
            ]
            t0 = time.perf_counter()
            ids = _as_gateway_hashes_them(await tok.aencode_chat_request(chat_body(msgs)))
            d = router.route(route_input_of(f"a{i}", ids, msgs), targets, now=float(i), shadow=False)
            out.append(time.perf_counter() - t0)
            router.shadow(d)
        return out

    asyn = asyncio.run(async_path())
    tok.close()
    per_candidate = {n: _rank_per_candidate(router, n, a.iters, rng) for n in (8, 64)}
    # The same with the models in a host's shared memory (``serve --workers N``): each prediction reads
    # the coefficients afresh, since another worker may have trained them.
    layout = HostLayout(workers=2, targets=128, instances=64, ring_words=64, metric_bytes=64, claim_slots=4)
    shared = Router(
        router.indexer,
        router.config,
        latency_store=HostLatency(HostMemory(layout, bytearray(layout.size()), threading.Lock())),
    )
    per_candidate_shared = {n: _rank_per_candidate(shared, n, a.iters, rng) for n in (8, 64)}
    res = {
        "prompt_tokens": len(warm),
        "decision_sync": {k: summary_us(v) for k, v in stages.items()},
        "decision_async_total": summary_us(asyn),
        "chosen_instances": sorted(chosen),
        "tokenizer_stats": msgspec.to_builtins(tok.stats()),
        "rank_per_candidate": per_candidate,
        "rank_per_candidate_host_shared_models": per_candidate_shared,
    }
    res["target_predicted_latency_le_20us_per_candidate"] = all(
        v[PREDICTED_LATENCY]["p50_us"] <= 20
        for pc in (per_candidate, per_candidate_shared)
        for v in pc.values()
    )
    res["target_decision_p50_le_500us"] = res["decision_sync"]["total"]["p50_us"] <= 500
    lanes = {str(n): _lanes_per_request(n, a.iters * 10, rng) for n in (10, 1000, 10_000)}
    res["flow_lanes_per_request"] = lanes
    res["target_lanes_flat_in_tenants"] = lanes["10000"]["p50_us"] <= 2 * lanes["10"]["p50_us"]
    accounts = {
        f"{n}_tenants_max_flows_{bound}": _accounts_memory(n, bound)
        for n in (20_000, 200_000)
        for bound in (10_000, 10_000_000)
    }
    res["flow_accounts"] = accounts
    bounded = [accounts[f"{n}_tenants_max_flows_10000"]["mib"] for n in (20_000, 200_000)]
    res["target_accounts_flat_in_tenants"] = bounded[1] <= 1.1 * bounded[0]
    return res


def _accounts_memory(tenants: int, max_flows: int) -> dict[str, Any]:
    """A queue's flow accounts after one charge of each of ``tenants`` one-off tenants (a header naming a
    user per request): the memory they hold (MiB, traced), and the time per charge (us, untraced: a run
    of its own)."""

    def run() -> FlowQueue[str]:
        q: FlowQueue[str] = FlowQueue(8, "work", max_flows=max_flows)
        for i in range(tenants):  # each request's flow built from its header, as the gateway does
            q.charge(Flow(f"user-{i}", 0), 100.0)
        return q

    t0 = time.perf_counter()
    run()
    per_charge = (time.perf_counter() - t0) / tenants
    tracemalloc.start()
    q = run()
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del q
    return {"mib": round(held / 2**20, 2), "us_per_charge": round(per_charge * 1e6, 2)}


def _lanes_per_request(tenants: int, iters: int, rng: random.Random) -> dict[str, Any]:
    """``WorkMeter.lanes`` and the admission's charge, per request, ``tenants`` metered (us)."""
    iso = Isolation(quiet_share=0.5)
    meter = WorkMeter(iso.half_life_s)
    flows = [Flow(f"key-{i}", 1) for i in range(tenants)]
    now = 0.0
    for f in flows:
        now += 1e-4
        meter.add(f.tenant, rng.randrange(100, 5000), now)
    times = []
    for _ in range(iters):
        f = flows[rng.randrange(tenants)]
        now += 1e-3
        t0 = time.perf_counter()
        heavy, _ = meter.lanes(iso, f, now, waiting=0)
        meter.add(f.tenant, 1200, now, light=not heavy)
        times.append(time.perf_counter() - t0)
    return summary_us(times)


def _rank_per_candidate(router: Router, n: int, iters: int, rng: random.Random) -> dict[str, Any]:
    """Each policy's ``rank`` over ``n`` candidates of mixed load and cache, per candidate (us)."""
    cands = [
        Candidate(
            InstanceId(f"c{i}"),
            0,
            TargetKey(f"c{i}"),
            in_flight=rng.randrange(0, 40),
            pending_prefill_tokens=rng.randrange(0, 30_000),
            decoding=rng.randrange(0, 30),
            hit_tokens=rng.randrange(0, 8000) // 16 * 16,
            cached_tokens=rng.randrange(0, 8000),
        )
        for i in range(n)
    ]
    book = router.latency
    for c in cands:  # every target's model warm: predictions, not the cold fallback, are timed
        for j in range(book.cfg.warmup):
            rid = RequestId(f"warm-{c.target}-{j}")
            book.dispatched(rid, 8000, c, 0.0)
            book.first_token(rid, 0.5 + 0.01 * j)
    book.train()
    view = RouteView(8200, b"k")
    out: dict[str, Any] = {}
    for name in (KV_AWARE, PREDICTED_LATENCY):
        policy = router.policy(name)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            policy.rank(view, cands, dry_run=True)
            times.append((time.perf_counter() - t0) / n)
        out[name] = summary_us(times)
    return out
