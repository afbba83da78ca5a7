"""Flows through the gateway, in front of a simulated fleet: tenants by API key, priority under saturation,
per-tenant rate limits, bad flow headers counted and served."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from kvrouter.flows import Flow
from kvrouter.lab.sim.server.fleet import SimFleet
from tests.support.gateway import MODEL, gateway, sim_fleet
from tests.support.wait import until

pytestmark = pytest.mark.asyncio(loop_scope="module")

FLOWS: dict[str, Any] = {
    "tenants": {
        "api_keys": {
            "sk-calm": {"name": "calm"},
            "sk-noisy": {"name": "noisy"},
            "sk-vip": {"name": "vip"},
            "sk-limited": {"name": "limited"},
        }
    },
    "flows": {
        "tenant_header": "x-tenant",
        "tenants": {"vip": {"priority": 2}, "limited": {"requests_per_minute": 2}},
    },
}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet() -> AsyncIterator[SimFleet]:
    async with sim_fleet(2) as f:
        yield f


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


async def chat(s: aiohttp.ClientSession, base: str, key: str, text: str, **headers: str) -> tuple[int, dict]:  # type: ignore[type-arg]
    h = {"Authorization": f"Bearer {key}", **headers}
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": text}]}
    async with s.post(f"{base}/v1/chat/completions", json=body, headers=h) as r:
        await r.read()
        return r.status, dict(r.headers)


async def metrics(s: aiohttp.ClientSession, base: str) -> str:
    """The gateway's ``/metrics`` text (answered 200)."""
    async with s.get(f"{base}/metrics") as r:
        assert r.status == 200
        return await r.text()


async def _faults(s: aiohttp.ClientSession, fleet: SimFleet, latency_s: float) -> None:
    for srv in fleet.servers:
        async with s.post(f"{srv.url}/sim/faults", json={"latency_s": latency_s}) as r:
            assert r.status == 200


@asynccontextmanager
async def slowed(s: aiohttp.ClientSession, fleet: SimFleet) -> AsyncIterator[list[str]]:
    """Every instance 0.3 s a request (a backlog builds at once), back to full speed after; yields the list
    that ``one`` appends each request's name to as it ends."""
    await _faults(s, fleet, 0.3)
    try:
        yield []
    finally:
        await _faults(s, fleet, 0.0)


async def one(s: aiohttp.ClientSession, base: str, done: list[str], key: str, name: str) -> None:
    """One chat of tenant ``key``, answered 200, its ``name`` appended to ``done`` when it ends."""
    st, _ = await chat(s, base, key, name)
    assert st == 200
    done.append(name)


async def test_rate_limited_tenant_gets_429_with_retry_after_and_others_do_not(fleet: SimFleet) -> None:
    async with gateway(fleet, **FLOWS) as (_, base), aiohttp.ClientSession() as s:
        got = [await chat(s, base, "sk-limited", f"hello {i}") for i in range(3)]
        assert [st for st, _ in got] == [200, 200, 429]
        assert int(got[2][1]["Retry-After"]) >= 25  # a request refills in 30 s
        assert (await chat(s, base, "sk-calm", "hello"))[0] == 200
        m = await metrics(s, base)
        assert samples(m, "kvrouter_flow_rate_limited_total") == {(("tenant", "limited"),): 1.0}
        assert samples(m, "kvrouter_rejections_total")[(("reason", "rate_limited"),)] == 1.0


async def test_bad_flow_headers_are_counted_and_served_at_the_default(fleet: SimFleet) -> None:
    async with gateway(fleet, **FLOWS) as (_, base), aiohttp.ClientSession() as s:
        # no key: the header may not name a tenant that has a key, nor raise a priority
        assert (await chat(s, base, "", "a", **{"x-tenant": "vip", "x-priority": "7"}))[0] == 200
        assert (await chat(s, base, "sk-calm", "b", **{"x-priority": "urgent!"}))[0] == 200
        assert (await chat(s, base, "", "c", **{"x-tenant": "t" * 100}))[0] == 200
        async with s.post(
            f"{base}/v1/route/explain",
            json={"model": MODEL, "messages": [{"role": "user", "content": "d"}]},
            headers={"x-tenant": "vip"},
        ) as r:
            assert r.status == 200
            assert (await r.json())["flow"] == {
                "tenant": "default",
                "priority": 0,
                "ignored_headers": ["tenant:needs_key"],
                "may_fill_reserve": False,  # below limits.saturation.reserved_priority (1)
                "heavy": False,  # no quiet targets (limits.isolation)
                "quiet_open": False,
                "objective": None,
            }
        w = samples(await metrics(s, base), "kvrouter_flow_header_warnings_total")
        assert w[(("header", "tenant"), ("reason", "needs_key"))] == 2.0
        assert w[(("header", "priority"), ("reason", "not_allowed"))] == 1.0
        assert w[(("header", "priority"), ("reason", "malformed"))] == 1.0
        assert w[(("header", "tenant"), ("reason", "malformed"))] == 1.0


async def test_priorities_clients_send_stay_among_the_configured_levels(fleet: SimFleet) -> None:
    async with gateway(fleet, **FLOWS) as (_, base), aiohttp.ClientSession() as s:
        for i in range(12):  # a client lowering its priority to twelve integers of its choosing
            assert (await chat(s, base, "sk-calm", f"low {i}", **{"x-priority": str(-1 - 7 * i)}))[0] == 200
        m = await metrics(s, base)
        admitted = samples(m, "kvrouter_flow_admitted_total")
        assert {dict(k)["priority"] for k in admitted} == {"-1"}  # levels: -1, 0 and vip's 2
        assert admitted[(("priority", "-1"), ("tenant", "calm"))] == 12.0
        w = samples(m, "kvrouter_flow_header_warnings_total")
        assert w[(("header", "priority"), ("reason", "snapped"))] == 11.0  # all but -1 itself


async def test_under_saturation_the_high_priority_tenant_goes_first(fleet: SimFleet) -> None:
    over = {**FLOWS, "limits": {"max_in_flight": 1, "queue_size": 64, "queue_timeout_s": 30}}
    async with gateway(fleet, **over) as (gw, base), aiohttp.ClientSession() as s, slowed(s, fleet) as done:
        flood = [asyncio.create_task(one(s, base, done, "sk-noisy", f"noisy {i}")) for i in range(8)]
        await until(lambda: gw.pipeline.gate.waiting >= 6, what="the noisy tenant's backlog")
        vip = asyncio.create_task(one(s, base, done, "sk-vip", "vip"))
        await until(lambda: gw.pipeline.gate.queue.depth(Flow("vip", 2)) == 1, what="vip waiting")
        older = gw.pipeline.gate.queue.depth(Flow("noisy", 0))
        assert older >= 2  # older waiters it must overtake
        await asyncio.gather(*flood, vip)
        # The next slot freed is vip's: before it end only the noisy requests not waiting when it came
        # (done or in flight), and perhaps the one sent to the other slot freed with it.
        assert done.index("vip") <= 8 - older + 1, (older, done)
        m = await metrics(s, base)
        admitted = samples(m, "kvrouter_flow_admitted_total")
        assert admitted[(("priority", "2"), ("tenant", "vip"))] == 1.0
        assert admitted[(("priority", "0"), ("tenant", "noisy"))] == 8.0
        assert samples(m, "kvrouter_flow_work_tokens_total")[(("priority", "0"), ("tenant", "noisy"))] > 0


async def test_a_tenants_work_is_its_uncached_prompt_and_its_decode(fleet: SimFleet) -> None:
    async with gateway(fleet, **FLOWS) as (_, base), aiohttp.ClientSession() as s:
        body = {
            "model": MODEL,
            "max_tokens": 3,
            "messages": [{"role": "user", "content": "a prompt no one has sent before, about work"}],
        }
        async with s.post(
            f"{base}/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-vip"}
        ) as r:
            assert r.status == 200
            usage = (await r.json())["usage"]
        work = samples(await metrics(s, base), "kvrouter_flow_work_tokens_total")
        # nothing of it was cached anywhere: all its prompt, plus the tokens vLLM reports it generated
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
        assert (
            work[(("priority", "2"), ("tenant", "vip"))]
            == usage["prompt_tokens"] + usage["completion_tokens"]
        )


def _slo_flows(on_miss: str) -> dict[str, Any]:
    # 1,000 prompt tokens a second: a prompt of a few dozen tokens is predicted at tens of milliseconds
    return {**FLOWS, "flows": {**FLOWS["flows"], "slo": {"on_miss": on_miss, "prefill_tokens_per_s": 1000.0}}}


async def test_an_objective_the_fleet_cannot_meet_is_refused_early_with_the_reason(fleet: SimFleet) -> None:
    async with gateway(fleet, **_slo_flows("reject")) as (_, base), aiohttp.ClientSession() as s:
        status, h = await chat(s, base, "sk-calm", "slo " * 50, **{"x-slo-ttft-ms": "1"})
        assert status == 429 and h["x-kvrouter-slo"].startswith("rejected; ttft; predicted_ms=")
        assert h["x-kvrouter-slo"].endswith("; by=rates")  # the learned models are cold
        status, h = await chat(s, base, "sk-calm", "slo " * 50, **{"x-slo-ttft-ms": "60000"})
        assert status == 200 and h["x-kvrouter-slo"] == "met"
        status, h = await chat(s, base, "sk-calm", "no objective")
        assert status == 200 and "x-kvrouter-slo" not in h
        status, h = await chat(s, base, "sk-calm", "bad", **{"x-slo-ttft-ms": "soon"})
        assert status == 200 and "x-kvrouter-slo" not in h  # ignored, counted
        m = await metrics(s, base)
        slo = samples(m, "kvrouter_flow_slo_total")
        assert slo[(("outcome", "rejected_ttft"), ("tenant", "calm"))] == 1.0
        assert slo[(("outcome", "met"), ("tenant", "calm"))] == 1.0
        assert samples(m, "kvrouter_rejections_total")[(("reason", "slo_ttft"),)] == 1.0
        warned = samples(m, "kvrouter_flow_header_warnings_total")
        assert warned[(("header", "ttft_slo"), ("reason", "malformed"))] == 1.0


async def test_an_objective_the_fleet_cannot_meet_is_served_at_the_lower_priority(fleet: SimFleet) -> None:
    async with gateway(fleet, **_slo_flows("demote")) as (_, base), aiohttp.ClientSession() as s:
        status, h = await chat(s, base, "sk-vip", "slo " * 50, **{"x-slo-ttft-ms": "1"})
        # not saturated: served, at priority -1 (sheddable), and told so
        assert status == 200 and h["x-kvrouter-slo"].startswith("demoted; ttft; predicted_ms=")
        m = await metrics(s, base)
        assert samples(m, "kvrouter_flow_slo_total")[(("outcome", "demoted_ttft"), ("tenant", "vip"))] == 1.0
        assert samples(m, "kvrouter_flow_admitted_total")[(("priority", "-1"), ("tenant", "vip"))] == 1.0


async def test_the_reserve_is_kept_from_a_low_priority_flood_for_high_priority(fleet: SimFleet) -> None:
    # 2 instances x 2 slots; half of each cap kept for priority 1 and above: the flood (priority 0) holds
    # one slot per instance and waits for those, and the vip request finds a kept slot at once.
    limits = {"max_in_flight": 2, "queue_size": 64, "queue_timeout_s": 30, "saturation": {"reserve": 0.5}}
    served = gateway(fleet, **{**FLOWS, "limits": limits})
    async with served as (gw, base), aiohttp.ClientSession() as s, slowed(s, fleet) as done:
        flood = [asyncio.create_task(one(s, base, done, "sk-noisy", f"noisy {i}")) for i in range(8)]
        await until(lambda: gw.pipeline.gate.waiting >= 6, what="the noisy tenant's backlog")
        assert gw.pipeline.router.load.total_in_flight() == 2  # the other two slots are kept
        await one(s, base, done, "sk-vip", "vip")
        # it did not wait for a slot: only the two noisy requests in flight when it came could end first
        assert done.index("vip") <= 2, done
        await asyncio.gather(*flood)
        m = await metrics(s, base)
        waits = samples(m, "kvrouter_flow_queue_wait_seconds_count")
        assert waits[(("priority", "2"), ("tenant", "vip"))] == 1.0


async def served_by(s: aiohttp.ClientSession, fleet: SimFleet) -> dict[str, float]:
    """Requests each instance has answered (vLLM's ``request_success`` in its own ``/metrics``)."""
    out = {}
    for srv in fleet.servers:
        async with s.get(f"{srv.url}/metrics") as r:
            out[srv.name] = sum(samples(await r.text(), "vllm:request_success_total").values())
    return out


async def test_a_flooding_tenant_is_kept_off_the_quiet_instance_and_the_calm_one_is_served_there(
    fleet: SimFleet,
) -> None:
    limits = {"isolation": {"quiet_share": 0.5, "idle_s": 0}}  # (lanes kept however slow the machine)
    async with gateway(fleet, **{**FLOWS, "limits": limits}) as (_, base), aiohttp.ClientSession() as s:

        async def explain(key: str) -> dict[str, Any]:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "which lane?"}]}
            async with s.post(
                f"{base}/v1/route/explain", json=body, headers={"Authorization": f"Bearer {key}"}
            ) as r:
                assert r.status == 200
                return await r.json()  # type: ignore[no-any-return]

        (quiet,) = (await explain("sk-calm"))["quiet_targets"]
        assert quiet in {srv.name for srv in fleet.servers}
        # the noisy tenant sends five times the calm one's work: over 1.5x its fair share of two
        for i in range(10):
            assert (await chat(s, base, "sk-noisy", f"noisy {i} " + "words " * 40))[0] == 200
            if i % 5 == 0:
                assert (await chat(s, base, "sk-calm", f"calm {i}"))[0] == 200
        assert (await explain("sk-noisy"))["flow"]["heavy"] is True
        assert (await explain("sk-calm"))["flow"]["heavy"] is False
        before = await served_by(s, fleet)
        for i in range(6):
            assert (await chat(s, base, "sk-noisy", f"more noisy {i} " + "words " * 40))[0] == 200
        mid = await served_by(s, fleet)
        assert mid[quiet] == before[quiet]  # not one of them on the quiet instance
        assert sum(mid.values()) == sum(before.values()) + 6
        for i in range(3):
            assert (await chat(s, base, "sk-calm", f"calm again {i}"))[0] == 200
        after = await served_by(s, fleet)
        assert after[quiet] == mid[quiet] + 3  # the calm tenant's, on the quiet instance
        heavy = samples(await metrics(s, base), "kvrouter_flow_heavy_total")
        assert heavy[(("priority", "0"), ("tenant", "noisy"))] >= 6
        assert (("priority", "0"), ("tenant", "calm")) not in heavy


async def test_a_header_naming_a_user_per_request_keeps_the_accounts_bounded(fleet: SimFleet) -> None:
    """``flows.max_flows`` 3: twelve users named by the tenant header leave three flows counted, nine
    forgotten, in ``/metrics``; every request is served."""
    cfg = {**FLOWS, "flows": {**FLOWS["flows"], "max_flows": 3}}
    async with gateway(fleet, **cfg) as (_, base), aiohttp.ClientSession() as s:
        for i in range(12):
            assert (await chat(s, base, "", f"hi {i}", **{"x-tenant": f"user-{i}"}))[0] == 200
        m = await metrics(s, base)
        assert samples(m, "kvrouter_flow_accounts") == {(): 3.0}
        assert samples(m, "kvrouter_flow_accounts_forgotten_total") == {(): 9.0}
