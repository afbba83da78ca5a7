"""LoRA adapters loaded and unloaded at run time on vLLM's CPU build (vllm-0 has ``--enable-lora``), through
the gateway: routed to the instance that holds the adapter, its blocks keyed apart from the base model's."""

from __future__ import annotations

import random
from pathlib import Path

import aiohttp

from tests.real.conftest import FIGURES, RealFleet
from tests.support.real_gateway import Served, Tally, fleet_file, reset_caches, send
from tests.support.real_vllm import MODEL, models_dir
from tests.support.real_workload import text


async def test_adapter_loaded_routed_keyed_apart_and_unloaded(fleet: RealFleet, tmp_path: Path) -> None:
    holder = fleet.by_name("vllm-0")
    async with aiohttp.ClientSession() as s:
        await reset_caches(s, fleet.servers)
    gw = await Served(fleet_file(tmp_path / "f.yaml", fleet.servers), fleet.log_dir).start()
    tally = Tally()
    prompt = "Adapter test. " + text(random.Random(3), 200)
    try:
        async with aiohttp.ClientSession() as s:
            load = {"lora_name": "lora-a", "lora_path": str(models_dir() / "lora-a")}
            hdr = {"x-kvrouter-instances": holder.spec.name}
            async with s.post(gw.url + "/v1/load_lora_adapter", json=load, headers=hdr) as r:
                assert r.status == 200, await r.text()
            for _ in range(2):
                o = await send(
                    s, gw.url, "/v1/completions", {"model": "lora-a", "prompt": prompt, "max_tokens": 2}
                )
                assert o.instance == holder.spec.name, o
                tally.add(tally.requests, o)
            assert tally.misses == [] and o.reported and o.reported > 0, tally.summary()
            # The same prompt on the base model shares no block with the adapter's.
            base = await send(
                s, gw.url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2}
            )
            tally.add(tally.requests, base)
            assert base.reported == 0 or base.instance != holder.spec.name, base
            async with s.post(gw.url + "/v1/unload_lora_adapter", json={"lora_name": "lora-a"}) as r:
                assert r.status == 200, await r.text()
            async with s.post(
                gw.url + "/v1/completions", json={"model": "lora-a", "prompt": prompt, "max_tokens": 2}
            ) as r:
                assert r.status == 404, (r.status, await r.text())
    finally:
        gw.stop()
    FIGURES["LoRA (runtime load/unload on vllm-0)"] = tally.summary()
    assert tally.misses == [], tally.summary()
