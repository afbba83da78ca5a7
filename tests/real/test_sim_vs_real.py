"""The simulator held to the real engine: one request sequence through ``kvrouter sim --capacity-blocks C``
and through a real vLLM with ``--num-gpu-blocks-override C + 1`` (vLLM keeps one block as its null block)
gives the same cached tokens on every request and the same stored and removed blocks, on a workload that
evicts.

Blocks are compared by what they hold, not by hash (vLLM's and the simulator's hashes differ): each
BlockStored block is named by its parent's name and its token ids, and a BlockRemoved by the name of the
block its hash stood for.  Each side's events are read back in full from its replay buffer after the run.
Requests ask for one output token: a block of generated tokens would hold the engines' different samples.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import yaml
import zmq
import zmq.asyncio

from indexer.subscriber import END_SEQ, replay_reply
from tests.real.conftest import CAPACITY, FIGURES, RealFleet
from tests.support.real_gateway import ROOT, reset_caches
from tests.support.real_vllm import BLOCK_SIZE, MODEL, models_dir
from tests.support.real_workload import AgentWorkload


class BlockLog(msgspec.Struct):
    stored: list[tuple[Any, ...]] = []
    removed: list[tuple[Any, ...]] = []
    cleared: int = 0


async def replayed(endpoint: str) -> list[bytes]:
    """Every batch the engine still buffers, from seq 0."""
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    out: list[bytes] = []
    try:
        async with asyncio.timeout(30):
            await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            while True:
                reply = replay_reply(await dealer.recv_multipart())
                assert reply is not None
                if reply[0] == END_SEQ:
                    return out
                out.append(reply[1])
    finally:
        dealer.close(linger=0)
        ctx.term()


def block_log(payloads: list[bytes]) -> BlockLog:
    """Stored and removed blocks named by content, from the last AllBlocksCleared on."""
    names: dict[Any, tuple[Any, ...]] = {}
    log = BlockLog()
    for payload in payloads:
        _ts, events, *_ = msgspec.msgpack.decode(payload)
        for ev in events:
            kind = ev["type"] if isinstance(ev, dict) else ev[0]
            if kind == "AllBlocksCleared":
                names.clear()
                log = BlockLog(cleared=log.cleared + 1)
            elif kind == "BlockStored":
                parent = names.get(ev["parent_block_hash"]) if ev["parent_block_hash"] is not None else ()
                toks = ev["token_ids"]
                for i, h in enumerate(ev["block_hashes"]):
                    name = (hash(parent), tuple(toks[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]))
                    names[h] = name
                    log.stored.append(name)
                    parent = name
            elif kind == "BlockRemoved":
                for h in ev["block_hashes"]:
                    log.removed.append(names.get(h, ("unknown", h)))
    return log


async def run_sequence(url: str, calls: list[tuple[str, dict[str, Any]]]) -> list[int]:
    out = []
    async with aiohttp.ClientSession() as s:
        for route, body in calls:
            async with s.post(url + route, json={**body, "max_tokens": 1}) as r:
                assert r.status == 200, await r.text()
                out.append((await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"])
    return out


async def start_sim(tmp: Path) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    fleet_out = tmp / "sim.yaml"
    args = [
        sys.executable, "-m", "kvrouter.cli", "sim", "--instances", "1", "--base-port", "0",
        "--fleet-out", str(fleet_out), "--profile", "test", "--speed", "100",
        "--tokenizer", str(models_dir() / "base"), "--model", MODEL,
        "--block-size", str(BLOCK_SIZE), "--capacity-blocks", str(CAPACITY),
        "--max-num-seqs", "8", "--max-num-batched-tokens", "2048", "--max-model-len", "2048",
    ]  # fmt: skip
    log = open(tmp / "sim.log", "wb")  # noqa: SIM115 - handed to the child
    proc = subprocess.Popen(args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    log.close()
    for _ in range(1200):
        if fleet_out.exists():
            return proc, yaml.safe_load(fleet_out.read_text())["instances"][0]
        if proc.poll() is not None:
            raise RuntimeError((tmp / "sim.log").read_text()[-3000:])
        await asyncio.sleep(0.1)
    proc.kill()
    raise RuntimeError("kvrouter sim did not come up")


async def test_simulator_equals_vllm_request_by_request(fleet: RealFleet, tmp_path: Path) -> None:
    real = fleet.by_name("vllm-1")
    calls = AgentWorkload(seed=6, systems=8, sessions=10).calls(50)
    async with aiohttp.ClientSession() as s:
        await reset_caches(s, [real])
    proc, sim = await start_sim(tmp_path)
    try:
        real_cached = await run_sequence(real.spec.url, calls)
        sim_cached = await run_sequence(sim["url"], calls)
        real_log = block_log(await replayed(f"tcp://127.0.0.1:{real.spec.replay_port}"))
        sim_log = block_log(await replayed(sim["replay"]))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    same = sum(a == b for a, b in zip(real_cached, sim_cached))
    FIGURES["simulator vs vLLM: cached tokens equal"] = f"{same}/{len(calls)}"
    FIGURES["simulator vs vLLM: stored/removed blocks (vLLM)"] = (
        f"{len(real_log.stored)}/{len(real_log.removed)}"
    )
    diffs = [(i, a, b) for i, (a, b) in enumerate(zip(real_cached, sim_cached)) if a != b]
    assert real_log.removed, "the workload must make vLLM evict"
    assert not diffs, diffs
    assert set(real_log.stored) == set(sim_log.stored)
    assert set(real_log.removed) == set(sim_log.removed)
    assert real_log.removed == sim_log.removed, "eviction order"
