"""``/metrics`` of ``kvrouter serve --workers 2`` is the host's, whichever worker answers the scrape:
scraped 50 times on fresh connections while requests flow, no counter ever goes down, no series vanishes,
and once the load is over the sums are the requests sent."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tests.kvrouter.host.test_serve_workers import HeldFleet, body, children, fresh, serve
from tests.support.wait import until

REQUESTS = 240
SCRAPES = 50


def samples(text: str) -> Iterator[tuple[str, str, tuple[tuple[str, str], ...], float]]:
    """(family type, sample name, labels, value) of every sample."""
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            yield fam.type, s.name, tuple(sorted(s.labels.items())), s.value


def monotone(typ: str, name: str) -> bool:
    """Samples that must never go down: counters, and histograms' buckets and counts (a histogram's sum
    may fall: kvrouter_cached_tokens_error observes negative differences)."""
    if typ == "counter":
        return not name.endswith("_created")
    return typ == "histogram" and name.endswith(("_bucket", "_count"))


async def scrape(base: str) -> tuple[int, str]:
    conn = aiohttp.TCPConnector(force_close=True)  # a fresh connection: either worker may answer
    async with aiohttp.ClientSession(connector=conn) as s, s.get(base + "/metrics") as r:
        return r.status, await r.text()


def total(text: str, name: str, **labels: str) -> float:
    return sum(
        v
        for _, n, lab, v in samples(text)
        if n == name and all(dict(lab).get(k) == want for k, want in labels.items())
    )


async def test_scrapes_of_two_workers_add_up_and_never_go_down(tmp_path: Path) -> None:
    async with HeldFleet(3) as fleet, serve(tmp_path, fleet.fleet()) as (base, pid):
        fleet.release.set()  # the instances answer at once
        sem = asyncio.Semaphore(16)

        async def one(i: int) -> int:
            async with sem:
                st, _ = await fresh("POST", base + "/v1/completions", body(i))
                return st

        load = asyncio.gather(*(one(i) for i in range(REQUESTS)))
        seen: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        workers_shown: set[str] = set()
        for n in range(SCRAPES):
            st, text = await scrape(base)
            assert st == 200
            now = {}
            for typ, name, lab, v in samples(text):
                if name == "kvrouter_worker":
                    workers_shown.add(dict(lab)["worker"])
                if monotone(typ, name):
                    now[(name, lab)] = v
            for key, before in seen.items():
                assert key in now, f"scrape {n}: {key} vanished"
                assert now[key] >= before, f"scrape {n}: {key} went from {before} to {now[key]}"
            seen = now
        assert await load == [200] * REQUESTS
        assert workers_shown == {"0", "1"}  # every scrape shows both workers, whichever answered

        st, text = await scrape(base)
        assert st == 200
        assert total(text, "kvrouter_requests_total", route="/v1/completions", status="200") == REQUESTS
        assert total(text, "kvrouter_decisions_total") == REQUESTS
        assert total(text, "kvrouter_routing_decision_seconds_count") == REQUESTS
        assert total(text, "kvrouter_upstream_ttft_seconds_count") == REQUESTS
        assert sum(fleet.served.values()) == REQUESTS
        # Per target, the host's TTFT counts are what each instance served.
        for i, port in enumerate(fleet.ports):
            assert total(text, "kvrouter_upstream_ttft_seconds_count", target=f"h{i}") == fleet.served[port]
        # Host gauges are the host's: nothing in flight, once, not once per worker.
        assert total(text, "kvrouter_instance_in_flight") == 0
        assert total(text, "kvrouter_instance_healthy") == 3
        # The host's flow accounts (one flow: the default tenant), reported once for the host.
        assert total(text, "kvrouter_flow_accounts") == 1
        assert total(text, "kvrouter_flow_accounts_forgotten_total") == 0
        # Each worker's own event loop is shown under its label.
        tasks = {dict(lab)["worker"] for _, n, lab, _ in samples(text) if n == "kvrouter_event_loop_tasks"}
        assert tasks == {"0", "1"}

        # A worker killed: the host goes on showing what it counted (its replacement starts from it).
        victim = children(pid)[1]
        os.kill(victim, signal.SIGKILL)
        await until(lambda: len(children(pid)) == 2 and victim not in children(pid), 30, "worker replaced")
        for _ in range(10):
            st, text = await scrape(base)
            assert st == 200
            assert total(text, "kvrouter_requests_total", route="/v1/completions", status="200") == REQUESTS
            assert total(text, "kvrouter_upstream_ttft_seconds_count") == REQUESTS
