"""Multimodal chat through the gateway and a simulated fleet serving a Qwen2.5-VL-style model directory.

The simulated instances expand and key images as vLLM does (held to vLLM's recordings in
tests/kvrouter/lab/sim/engine/test_mm_events.py); here the gateway must predict, from the same request,
exactly the cached tokens the instance reports: the same image again hits through the image, another image
at the same place hits only up to it.  Broken media is the client's error (400), as vLLM answers it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvrouter.lab.sim.server.fleet import SimFleet
from tests.support.gateway import MODEL, gateway, sim_fleet
from tests.support.mm_chat import image_chat, png_url
from tests.support.mm_models import build_mm_model
from tests.support.wait import until


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[SimFleet]:
    model = build_mm_model("qwen2_5_vl", tmp_path / "qwen2_5_vl")
    async with sim_fleet(2, tokenizer=str(model)) as f:
        yield f


SYSTEM = "You look at screenshots and answer briefly. " * 20


def _body(image: str, question: str) -> dict[str, Any]:
    return image_chat(MODEL, SYSTEM, image, question)


async def _post(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, dict[str, str], Any]:
    async with s.post(url, json=body) as r:
        return r.status, dict(r.headers), await r.json(content_type=None)


async def test_images_route_to_their_cache(fleet: SimFleet) -> None:
    red, blue = png_url(640, 480, 3), png_url(640, 480, 5)
    async with gateway(fleet) as (gw, base), aiohttp.ClientSession() as s:
        url = f"{base}/v1/chat/completions"
        st, h, d = await _post(s, url, _body(red, "What is open?"))
        assert st == 200, d
        first = h["x-kvrouter-instance"]
        await until(lambda: any(gw.indexer.index.blocks(src)[0] > 0 for src in gw.indexer.sources()))
        st, h, d = await _post(s, url, _body(red, "And now?"))
        assert st == 200, d
        pred, real = int(h["x-kvrouter-cached-tokens"]), d["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert h["x-kvrouter-instance"] == first and pred == real and real > 200, (pred, real)
        through_image = real
        st, h, d = await _post(s, url, _body(blue, "And now?"))
        assert st == 200, d
        pred, real = int(h["x-kvrouter-cached-tokens"]), d["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert pred == real and 0 < real < through_image, (pred, real, through_image)
        m = await (await s.get(f"{base}/metrics")).text()
        assert 'kvrouter_multimodal_items_total{path="data"} 3.0' in m
        # the start-up parity probes include images: chat on /tokenize, which the instances answer
        probe = 'method="tokenize",model="sim-model",result="match",route="chat+image"'
        for _ in range(300):
            m = await (await s.get(f"{base}/metrics")).text()
            if probe in m:
                break
            await asyncio.sleep(0.1)
        assert probe in m and 'result="mismatch"' not in m


async def test_broken_media_is_the_clients_error(fleet: SimFleet) -> None:
    async with gateway(fleet) as (_, base), aiohttp.ClientSession() as s:
        url = f"{base}/v1/chat/completions"
        for image in ("data:image/png;base64,iVBORw0KGgo!!!!", "data:image/png;base64," + "QUJD" * 10):
            st, _, d = await _post(s, url, _body(image, "x"))
            assert st == 400, d
        # a data URL that is not base64: vLLM answers 501, so the gateway forwards it without ids
        st, h, d = await _post(s, url, _body("data:image/png,abcd", "x"))
        assert st != 400 or "x-kvrouter-instance" in h, (st, d)
