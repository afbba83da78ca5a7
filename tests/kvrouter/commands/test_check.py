"""``kvrouter check`` against a live simulated fleet, run as a user runs it (a separate process)."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import yaml

from kvrouter.lab.sim.server.fleet import SimFleet
from tests.support.gateway import MODEL, sim_fleet
from tests.support.net import free_port

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet() -> AsyncIterator[SimFleet]:
    async with sim_fleet(2) as f:
        async with aiohttp.ClientSession() as s:  # something stored, so replay has a batch to show
            body = {"model": MODEL, "prompt": "alpha beta gamma " * 40, "max_tokens": 2}
            for srv in f.servers:
                async with s.post(f"{srv.url}/v1/completions", json=body) as r:
                    assert r.status == 200
        yield f


async def run_check(tmp: Path, doc: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    path = tmp / "fleet.yaml"
    path.write_text(yaml.safe_dump(doc))
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvrouter.cli",
        "check",
        "--fleet",
        str(path),
        "--json",
        "--timeout",
        "20",  # per check: generous, a healthy instance on a loaded 2-core machine is still healthy
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None and out, err.decode()[-2000:]
    return proc.returncode, json.loads(out)


def verdicts(report: dict[str, Any], instance: str) -> dict[str, str]:
    return {c["name"]: c["verdict"] for c in report["instances"][instance]}


async def test_a_healthy_fleet_passes(fleet: SimFleet, tmp_path: Path) -> None:
    code, rep = await run_check(tmp_path, fleet.fleet_dict())
    failed = [(i, c) for i, cs in rep["instances"].items() for c in cs if c["verdict"] != "ok"]
    assert code == 0 and rep["ok"], failed
    for srv in fleet.servers:
        v = verdicts(rep, srv.instance.config.name)
        assert v == {"http": "ok", "models": "ok", "parity": "ok", "events": "ok"}, rep
    detail = {c["name"]: c["detail"] for c in rep["instances"][fleet.servers[0].instance.config.name]}
    assert MODEL in detail["models"] and "block size 16" in detail["events"]


async def test_a_misspelt_key_stops_before_any_instance(fleet: SimFleet, tmp_path: Path) -> None:
    doc = fleet.fleet_dict() | {"limits": {"concurency_threshold": 64}}
    code, rep = await run_check(tmp_path, doc)
    assert (
        code == 2 and "limits.concurency_threshold (did you mean concurrency_threshold?)" in rep["fleet_file"]
    )


async def test_unreachable_mismatched_and_misrendering_instances_fail(
    fleet: SimFleet, tmp_path: Path
) -> None:
    doc = fleet.fleet_dict()
    doc["instances"].append({"name": "gone", "url": f"http://127.0.0.1:{free_port()}"})
    victim = fleet.servers[1]
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{victim.url}/sim/faults", json={"render_fault": True}) as r:
            assert r.status == 200
        try:
            code, rep = await run_check(tmp_path, doc)
            assert code == 1 and not rep["ok"]
            assert verdicts(rep, "gone")["http"] == "fail"
            assert verdicts(rep, victim.instance.config.name)["parity"] == "fail"
            assert verdicts(rep, fleet.servers[0].instance.config.name)["parity"] == "ok"
            code, rep = await run_check(tmp_path, fleet.fleet_dict() | {"block_size": 32})
            assert code == 1
            ev = next(
                c for c in rep["instances"][fleet.servers[0].instance.config.name] if c["name"] == "events"
            )
            assert (
                ev["verdict"] == "fail"
                and "block size 16 on the engine, 32 in the fleet file" in ev["detail"]
            )
        finally:
            async with s.post(f"{victim.url}/sim/faults", json={"render_fault": False}):
                pass


async def test_offload_placeholders_are_explained_with_the_setting_that_fixes_them(tmp_path: Path) -> None:
    # The simulator's CPU tier announces its copies as vLLM's OffloadingConnector does by default:
    # BlockStored placeholders without token ids.
    async with sim_fleet(1, cpu_offload_blocks=256) as f, aiohttp.ClientSession() as s:
        body = {"model": MODEL, "prompt": "delta epsilon zeta " * 40, "max_tokens": 2}
        async with s.post(f"{f.servers[0].url}/v1/completions", json=body) as r:
            assert r.status == 200
        code, rep = await run_check(tmp_path, f.fleet_dict())
        name = f.servers[0].instance.config.name
        check = next(c for c in rep["instances"][name] if c["name"] == "events")
        assert code == 0 and check["verdict"] == "warn", rep
        assert "block size 16" in check["detail"] and "offload events without token ids" in check["detail"]
        assert '"self_describing_kv_events": true' in check["detail"]
