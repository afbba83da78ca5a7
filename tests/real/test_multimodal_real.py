"""Images through the gateway to two real vLLM servers of a tiny Qwen2.5-VL (random weights, made locally by
``tools/real_vllm_model.py``): the router's predicted cached tokens against the ``cached_tokens`` vLLM
reports, and the same image sent again routed to the instance that holds it.

The two servers are this module's own (the session fleet serves a text model); each has the session
fleet's block budget.  The router computes the image's placeholder count from the model directory's
processor files and names the image as vLLM does (its bytes hashed with ``--model``'s path).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.real.conftest import CAPACITY, FIGURES
from tests.support.mm_chat import image_chat, png_url
from tests.support.net import free_port
from tests.support.real_gateway import Outcome, Served, fleet_file, metric, reset_caches, send
from tests.support.real_vllm import BLOCK_SIZE, VL_MODEL, RealVllm, VllmSpec, models_dir, running

SYSTEM = "You look at screenshots and answer in one short sentence. " * 16


@pytest.fixture(scope="module")
def vl_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[RealVllm], Path]]:
    log_dir = tmp_path_factory.mktemp("real-vllm-vl")
    specs = [
        VllmSpec(f"vllm-vl-{i}", free_port(), free_port(), free_port(), blocks=CAPACITY + 1, model="qwen-vl")
        for i in range(2)
    ]
    with running(specs, log_dir) as servers:
        yield servers, log_dir


def _body(image: str, question: str) -> dict[str, Any]:
    return image_chat(VL_MODEL, SYSTEM, image, question)


async def _until_indexed(s: aiohttp.ClientSession, gw: Served, instance: str, n: int) -> None:
    """Until the router's index holds at least ``n`` blocks of ``instance`` (from vLLM's KV events); the
    deadline only bounds a hang."""
    deadline = time.monotonic() + 60
    while True:
        async with s.get(gw.url + "/health") as r:
            body = await r.json(content_type=None)
        held = sum(src["blocks"].get("GPU", 0) for src in body["index"] if src["instance"] == instance)
        if held >= n:
            return
        assert time.monotonic() < deadline, f"{instance}: {held} of {n} blocks indexed in 60 s"
        await asyncio.sleep(0.02)


async def test_images_route_to_their_cache_on_real_vllm(
    vl_servers: tuple[list[RealVllm], Path], tmp_path: Path
) -> None:
    servers, log_dir = vl_servers
    async with aiohttp.ClientSession() as s:
        await reset_caches(s, servers)
    path = fleet_file(tmp_path / "f.yaml", servers, tokenizer=str(models_dir() / "qwen-vl"))
    gw = await Served(path, log_dir).start()
    seen: list[Outcome] = []
    try:
        async with aiohttp.ClientSession() as s:
            url = "/v1/chat/completions"
            a, b = png_url(300, 200, 3), png_url(300, 200, 5)  # same size: the same placeholder count
            first = await send(s, gw.url, url, _body(a, "What is open?"))
            seen.append(first)
            assert first.status == 200 and first.instance, first.body
            assert first.predicted == first.reported == 0, first
            # the first answer's blocks reach the router as vLLM's events, not with the answer
            stored = first.prompt_tokens // BLOCK_SIZE if first.prompt_tokens else 0
            await _until_indexed(s, gw, first.instance, stored)
            again = await send(s, gw.url, url, _body(a, "And what is open now?"))
            seen.append(again)
            assert again.status == 200, again.body
            # the same bytes: the same identifier, so the blocks through the image hit where it is cached
            assert again.instance == first.instance, (first, again)
            assert again.predicted == again.reported, again
            through_image = again.reported or 0
            assert through_image >= stored * BLOCK_SIZE - BLOCK_SIZE, (stored, again)
            other = await send(s, gw.url, url, _body(b, "And what is open now?"))
            seen.append(other)
            assert other.status == 200, other.body
            # another image at the same place: only the blocks before its placeholder can hit
            assert other.predicted == other.reported and 0 < (other.reported or 0) < through_image, (
                other,
                through_image,
            )
            m = await gw.metrics()
            assert metric(m, "kvrouter_multimodal_items_total", path="data") == 3.0, m
    finally:
        gw.stop()
    FIGURES["multimodal (Qwen2.5-VL, data: URLs) predicted/reported"] = [
        (o.instance, o.predicted, o.reported, o.prompt_tokens) for o in seen
    ]
