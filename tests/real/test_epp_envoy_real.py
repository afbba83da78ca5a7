"""``kvrouter epp`` (the Endpoint Picker, a process) behind a real Envoy in front of the real vLLM servers:
the same predictions as ``serve``, equal to what vLLM reports."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import aiohttp

from tests.real.conftest import FIGURES, RealFleet
from tests.support.envoy import envoy_config, running_envoy
from tests.support.net import free_port
from tests.support.real_gateway import ROOT, Tally, fleet_file, reset_caches, run_calls
from tests.support.real_workload import AgentWorkload


async def test_epp_behind_envoy_predicts_what_vllm_reports(fleet: RealFleet, tmp_path: Path) -> None:
    async with aiohttp.ClientSession() as s:
        await reset_caches(s, fleet.servers)
    grpc, http = free_port(), free_port()
    path = fleet_file(tmp_path / "f.yaml", fleet.servers)
    log = open(tmp_path / "epp.log", "wb")  # noqa: SIM115 - handed to the child
    epp = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvrouter.cli",
            "epp",
            "--fleet",
            str(path),
            "--grpc-port",
            str(grpc),
            "--port",
            str(http),
        ],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(600):
                assert epp.poll() is None, (tmp_path / "epp.log").read_text()[-3000:]
                try:
                    async with s.get(f"http://127.0.0.1:{http}/health") as r:
                        body = await r.json()
                        if r.status == 200 and all(i["healthy"] for i in body["instances"].values()):
                            break
                except (aiohttp.ClientError, ValueError):
                    pass
                await asyncio.sleep(0.2)
            else:
                raise AssertionError("epp not healthy")
        cfg = envoy_config(free_port(), free_port(), grpc)
        async with running_envoy(cfg, tmp_path / "envoy") as base:
            tally: Tally = await run_calls(base, AgentWorkload(seed=8).calls(30))
    finally:
        epp.terminate()
        epp.wait(timeout=30)
    FIGURES["kvrouter epp behind Envoy"] = tally.summary()
    assert tally.exact >= tally.requests - 1, tally.summary()
    assert tally.reported_cached > 0
