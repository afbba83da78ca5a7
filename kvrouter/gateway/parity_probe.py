"""Asking the fleet's own ``POST /tokenize`` whether it computes the token ids the router computes.

The verdicts live in ``pipeline.parity.ParityTracker`` (pure); this shell makes the calls:

::

    start-up, and an instance back in rotation   the probe set, on each instance serving the model
    every few ms                                  the checks the pipeline queued (sampled, shortfall)
    every recheck_interval_s                      the probe set again for each failing model

A call that fails is an ``error`` result (it says nothing about parity); only a mismatch fails a model.
Logs carry the model, the instance, the reason and the first differing position, never the content.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import aiohttp
import msgspec

from ..api.errors import ApiError
from ..api.requests import Kind, parse_body
from ..pipeline import RequestPipeline
from ..pipeline.parity import ProbeCase, Reason, tokenize_body
from .upstream import UpstreamPool

log = logging.getLogger("kvrouter.gateway.parity")

_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
PROBE_SET: list[tuple[Kind, dict[str, Any]]] = [
    (
        "chat",
        {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}]},
    ),
    ("chat", {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [_TOOL]}),
    (
        "chat",
        {
            "messages": [
                {"role": "user", "content": "Weather in Oslo?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "-3 C, snow"},
                {"role": "user", "content": "And tomorrow — warmer? 🌡️"},
            ],
            "tools": [_TOOL],
        },
    ),
    ("completions", {"prompt": "The capital of France is"}),
]
"""What each model is checked with: plain chat, tools, a tool call with its result, and a completion."""


class ParityProber:
    def __init__(
        self,
        pipeline: RequestPipeline,
        pool: UpstreamPool,
        *,
        poll_s: float = 0.05,
    ) -> None:
        self.pipeline = pipeline
        self.tracker = pipeline.parity
        self.cfg = pipeline.cfg.parity
        self.pool = pool
        self.poll_s = poll_s
        self.session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._back: set[str] = set()

    async def start(self, session: aiohttp.ClientSession) -> None:
        self.session = session
        if self.cfg.enabled:
            self._task = asyncio.create_task(self._run(), name="parity-prober")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def instance_back(self, name: str) -> None:
        """An instance (re)joined the rotation: check it with the probe set (it may have restarted with
        another template)."""
        self._back.add(name)

    # ------------------------------------------------------------------ the loop
    async def _run(self) -> None:
        if self.cfg.startup:
            for name in list(self.pool.upstreams):
                await self.check_instance(name, "startup")
        next_recheck = time.monotonic() + self.cfg.recheck_interval_s
        while True:
            for case in self.tracker.take():
                await self._check(case)
            while self._back:
                await self.check_instance(self._back.pop(), "startup")
            if time.monotonic() >= next_recheck:
                next_recheck = time.monotonic() + self.cfg.recheck_interval_s
                for model in self.tracker.failing():
                    await self.recheck(model)
            await asyncio.sleep(self.poll_s)

    async def recheck(self, model: str | None) -> None:
        n = 0
        for name, u in list(self.pool.upstreams.items()):
            if u.healthy and u.serves(model):
                n += sum(
                    1 for r in await self.check_instance(name, "recheck", models=[model]) if r != "skipped"
                )
        self.tracker.recheck_done(model, n)

    # ------------------------------------------------------------------ checks
    async def probe_cases(self, model: str | None, reason: Reason, instance: str) -> list[ProbeCase]:
        """The probe set for ``model`` with the router's own ids (empty: no tokenizer for it)."""
        out = []
        for kind, body in PROBE_SET:
            raw = msgspec.json.encode({"model": model, **body} if model is not None else body)
            try:
                req = parse_body(raw, kind)
                ours = await self.pipeline.tokens.tokens(req)
            except ApiError:
                continue  # the model cannot render this probe (e.g. no tools in its template): skip it
            tb = tokenize_body(req)
            if ours is None or tb is None:
                continue
            out.append(ProbeCase(model, tb, [int(t) for t in ours], reason, instance))
        return out

    async def check_instance(
        self, name: str, reason: Reason, *, models: list[str | None] | None = None
    ) -> list[str]:
        """Every probe of every model ``name`` serves (or of ``models``), on ``name``: the results."""
        u = self.pool.upstreams.get(name)
        if u is None:
            return []
        # adapters render with their base model's tokenizer and template: checked through the base model
        bases = [m for m in u.cfg.models or u.served_models if m not in u.adapters]
        served: list[str | None] = list(bases) or [None]
        wanted = models if models is not None else served
        results = []
        for model in wanted:
            for case in await self.probe_cases(model, reason, name):
                results.append(await self._check(case))
        return results

    async def _check(self, case: ProbeCase) -> str:
        name = case.instance if case.instance in self.pool.upstreams else None
        if name is None:
            name = next(
                (n for n, u in self.pool.upstreams.items() if u.healthy and u.serves(case.model)), None
            )
        if name is None:
            return "skipped"
        theirs = await self.tokenize(name, case.body)
        result = self.tracker.record(case, theirs, name, time.monotonic())
        self.pipeline.m.parity_checks.labels(str(case.model), result).inc()
        if result == "mismatch":
            mm = self.tracker.of(case.model).last_mismatch
            assert mm is not None
            log.warning(
                "token parity mismatch: this model is routed without token-based predictions until it passes",
                extra={
                    "model": case.model,
                    "instance": name,
                    "reason": case.reason,
                    "first_difference": mm.position,
                    "ours_len": mm.ours,
                    "theirs_len": mm.theirs,
                },
            )
        return result

    async def tokenize(self, name: str, body: dict[str, Any]) -> list[int] | None:
        """The instance's token ids for ``body`` (None when it could not answer)."""
        if self.session is None:
            return None
        try:
            async with self.session.post(
                self.pool.url(name) + "/tokenize",
                json=body,
                timeout=aiohttp.ClientTimeout(total=self.cfg.timeout_s),
            ) as r:
                if r.status != 200:
                    return None
                got = msgspec.json.decode(await r.read())
        except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError, KeyError):
            return None
        tokens = got.get("tokens") if isinstance(got, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            return None
        return tokens
