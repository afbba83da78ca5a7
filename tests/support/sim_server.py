"""Helpers for the simulated-instance tests (no tests here): the shared tokenizer, servers on free ports
below 32768, SSE reading, waiting for a condition."""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp

from kvrouter.lab.sim.engine import CacheConfig, EngineConfig, SchedulerConfig
from kvrouter.lab.sim.server.answers import AnswerVocab
from kvrouter.lab.sim.server.faults import FaultConfig
from kvrouter.lab.sim.server.fleet import free_port_block
from kvrouter.lab.sim.server.instance import SimInstance, SimInstanceConfig
from kvrouter.lab.sim.server.server import SimServer
from kvrouter.lab.sim.server.tokenizer import load_sim_tokenizer
from tokenizer_cache import CachedTokenizer, default_tokenizer_path

BS = 16


@functools.cache
def shared_sim_tokenizer() -> tuple[CachedTokenizer, str | None]:
    """The default tokenizer with the simulator's chat template, loaded once per test process, and that
    template (what ``load_sim_tokenizer`` returns: a fleet sharing it writes it to its fleet file)."""
    return load_sim_tokenizer(default_tokenizer_path())


@functools.cache
def shared_tokenizer() -> tuple[CachedTokenizer, AnswerVocab]:
    """The shared simulator tokenizer with its answer vocabulary."""
    tok, _ = shared_sim_tokenizer()
    return tok, AnswerVocab.from_tokenizer(tok)


def instance_config(dp_size: int = 1, *, events: bool = True, **kw: Any) -> SimInstanceConfig:
    """A test-profile instance on free ports: HTTP, PUB (+ ranks), ROUTER (+ ranks)."""
    base = free_port_block(1 + 2 * dp_size)
    engine = kw.pop(
        "engine",
        EngineConfig(
            profile="test",
            cache=CacheConfig(block_size=BS, num_gpu_blocks=kw.pop("capacity", 512)),
            scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=2048),
        ),
    )
    return SimInstanceConfig(
        name=kw.pop("name", "sim-t"),
        port=base,
        events_port=base + 1 if events else None,
        replay_port=base + 1 + dp_size if events else None,
        dp_size=dp_size,
        engine=engine,
        faults=kw.pop("faults", FaultConfig()),
        **kw,
    )


@asynccontextmanager
async def running(cfg: SimInstanceConfig) -> AsyncIterator[SimServer]:
    tok, vocab = shared_tokenizer()
    server = SimServer(SimInstance(cfg, tok, vocab=vocab))
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[tuple[float, str]]:
    """(arrival time, data) of each SSE event, as it arrives."""
    buf = b""
    async for chunk in resp.content.iter_any():
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            assert event.startswith(b"data: "), event
            yield time.monotonic(), event[6:].decode()


def long_text(n_words: int, seed: int = 0) -> str:
    words = [
        "alpha",
        "beta",
        "gamma",
        "delta",
        "cache",
        "router",
        "token",
        "prefix",
        "block",
        "hash",
        "worker",
        "request",
        "model",
    ]
    return " ".join(words[(i * 7 + seed) % len(words)] + str(i % 97) for i in range(n_words))
