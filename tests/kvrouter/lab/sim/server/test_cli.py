"""``kvrouter sim`` as a real process: the fleet file appears only once every instance is healthy, it
describes the running fleet, and SIGTERM stops everything cleanly (exit 0, every port released)."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from indexer.config import load_fleet
from kvrouter.lab.sim.server.fleet import SimFleet, SimFleetConfig, free_port_block
from tests.support.sim_server import shared_tokenizer
from tests.support.wait import until


async def test_kvrouter_sim_writes_fleet_file_when_healthy_and_stops_on_sigterm(tmp_path: Path) -> None:
    out = tmp_path / "fleet.yaml"
    base = free_port_block(2 * 5)
    cmd = [
        sys.executable, "-m", "kvrouter.cli", "--log-level", "WARNING", "sim",
        "--instances", "2", "--dp-size", "2", "--fleet-out", str(out), "--base-port", str(base),
        "--profile", "test", "--drop-rate", "0.1",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        await until(lambda: out.exists() or proc.poll() is not None, what="fleet file")
        assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
        fleet = load_fleet(out)
        assert [i.name for i in fleet.instances] == ["sim-0", "sim-1"]
        assert fleet.block_size == 16 and fleet.tokenizer
        i0, i1 = fleet.instances
        assert i0.url == f"http://127.0.0.1:{base}" and i1.url == f"http://127.0.0.1:{base + 5}"
        assert i0.events == f"tcp://127.0.0.1:{base + 1}" and i0.replay == f"tcp://127.0.0.1:{base + 3}"
        assert i0.dp_size == 2 and i0.models == ["sim-model"]
        async with aiohttp.ClientSession() as http:
            for inst in fleet.instances:  # healthy the moment the file exists
                async with http.get(f"{inst.url}/health") as r:
                    assert r.status == 200
            async with http.post(f"{i1.url}/v1/completions", json={"prompt": "hi", "max_tokens": 3}) as r:
                assert (await r.json())["usage"]["completion_tokens"] == 3
            async with http.get(f"{i1.url}/sim/faults") as r:
                assert (await r.json())["drop_rate"] == 0.1
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=15)
        assert rc == 0, proc.communicate()[1].decode()[-2000:]
        assert time.monotonic() - t0 < 5
        for p in range(base, base + 10):  # nothing left listening (TIME_WAIT is allowed)
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("127.0.0.1", p))
                s.listen()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout:
            proc.stdout.close()
        if proc.stderr:
            proc.stderr.close()


async def test_a_stopped_fleet_leaves_no_task_and_no_port() -> None:
    tok, _ = shared_tokenizer()
    before = asyncio.all_tasks()
    fleet = SimFleet(SimFleetConfig(instances=2, dp_size=2, profile="test"), tokenizer=tok)
    await fleet.start()
    ports = [s.port for s in fleet.servers]
    assert len(asyncio.all_tasks() - before) >= 8  # rank loops and replay routers
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{fleet.urls[0]}/v1/completions", json={"prompt": "x"}) as r,
    ):
        assert r.status == 200
    await fleet.stop()
    await fleet.stop()  # idempotent
    assert asyncio.all_tasks() - before == set()
    for p in range(ports[0], ports[-1] + 5):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", p))
            s.listen()
