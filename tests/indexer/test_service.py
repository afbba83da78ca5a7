"""The indexer's HTTP API over real HTTP on 127.0.0.1."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp.test_utils import TestClient, TestServer

from indexer import Indexer
from indexer.encode import PayloadEncoder
from indexer.service import make_indexer_app

TOKS = list(range(1000, 1064))


@pytest.fixture
async def client() -> AsyncIterator[TestClient[object, object]]:
    ix = Indexer(16)
    e = PayloadEncoder()
    ix.apply_payload("vllm-0", e.batch([e.stored([1, 2, 3, 4], None, TOKS, 16)], ts=1.0))
    ix.apply_payload("vllm-1", e.batch([e.stored([5, 6], None, TOKS[:32], 16, medium="CPU")], ts=1.0))
    app = make_indexer_app(ix, max_body_bytes=64 * 1024)
    async with TestClient(TestServer(app, host="127.0.0.1")) as c:
        yield c


async def test_lookup_by_token_ids(client: TestClient[object, object]) -> None:
    r = await client.post("/v1/cache/lookup", json={"token_ids": [*TOKS, 1, 2, 3]})
    assert r.status == 200
    body = await r.json()
    assert body["block_size"] == 16 and body["num_tokens"] == 67
    by = {m["instance"]: m for m in body["instances"]}
    assert by["vllm-0"]["matched_blocks"] == 4 and by["vllm-0"]["matched_tokens"] == 64
    assert by["vllm-0"]["tiers"] == {"GPU": 4} and by["vllm-0"]["trust"] == "exact"
    assert by["vllm-1"]["matched_blocks"] == 2 and by["vllm-1"]["tiers"] == {"GPU": 0, "CPU": 2}


async def test_lookup_with_salt_sees_nothing(client: TestClient[object, object]) -> None:
    r = await client.post("/v1/cache/lookup", json={"token_ids": TOKS, "cache_salt": "t1"})
    assert all(m["matched_blocks"] == 0 for m in (await r.json())["instances"])


@pytest.mark.parametrize(
    "body,status,needle",
    [
        (b"", 400, "empty body"),
        (b"{not json", 400, "invalid request"),
        (b'{"token_ids": "abc"}', 400, "invalid request"),
        (b'{"token_ids": [1, -5]}', 400, "token_ids"),
        (b'{"token_ids": [1, 99999999999]}', 400, "token_ids"),
        (b'{"prompt": [1, -5]}', 400, "prompt"),
        (b'{"token_ids": [1], "cache_salt": ""}', 400, "cache_salt"),
        (b'{"token_ids": [1], "cache_salt": 5}', 400, "invalid request"),
        (b'{"prompt": "hello"}', 400, "no tokenizer"),
        (b'{"token_ids": [1], "prompt": "x"}', 400, "exactly one"),
        (b"{}", 400, "exactly one"),
        (b"[1, 2]", 400, "invalid request"),
        (b'{"token_ids": [' + b"1," * 40000 + b"1]}", 413, ""),
    ],
)
async def test_bad_lookups_get_4xx_with_reason(
    client: TestClient[object, object], body: bytes, status: int, needle: str
) -> None:
    r = await client.post("/v1/cache/lookup", data=body, headers={"Content-Type": "application/json"})
    assert r.status == status
    text = await r.text()
    assert needle in text


async def test_health_fleet_metrics(client: TestClient[object, object]) -> None:
    r = await client.get("/health")
    assert r.status == 200
    h = await r.json()
    assert h["status"] == "ok" and {s["instance"] for s in h["sources"]} == {"vllm-0", "vllm-1"}
    f = await (await client.get("/v1/fleet")).json()
    v0 = next(s for s in f["sources"] if s["instance"] == "vllm-0")
    assert v0["blocks"] == {"GPU": 4, "CPU": 0, "STORAGE": 0} and v0["trust"] == "exact"
    m = await (await client.get("/metrics")).text()
    assert "kvrouter_indexer_blocks_stored_total 6.0" in m
    assert 'kvrouter_indexer_source_blocks{medium="CPU",source="vllm-1/0"} 2.0' in m
    assert 'kvrouter_indexer_source_trust{source="vllm-0/0",trust="exact"} 1.0' in m
