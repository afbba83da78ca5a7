"""Asking the fleet whether it computes the token ids the router computes: ``POST /tokenize`` for chat and
completions, vLLM's render routes (``/v1/responses/render``, ``/v1/messages/render``) for Responses and
Messages requests, sent as the client sent them (answered 403 by `vllm serve` without --enable-scale-out:
"unsupported", then the cached tokens reported on those requests are compared instead).

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
import base64
import contextlib
import io
import logging
import time
from typing import Any

import aiohttp
import msgspec
from PIL import Image

from ..api.errors import ApiError
from ..api.requests import Kind, parse_body
from ..pipeline import RequestPipeline
from ..pipeline.parity import RENDER_PATHS, ProbeCase, Reason, probe_request
from .upstream import UpstreamPool

log = logging.getLogger("kvrouter.gateway.parity")
Memo = dict[str | None, list[ProbeCase]]
"""A sweep's probe sets by model, made once for every instance the sweep checks."""
# A render route an instance does not serve: 403 (`vllm serve` without --enable-scale-out), 404, 405.
_NOT_SERVED = (403, 404, 405)
_UNSUPPORTED = object()

_TOOL: dict[str, Any] = {
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
    (
        "responses",
        {
            "instructions": "You are terse.",
            "input": [
                {"role": "user", "content": "Weather in Oslo?"},
                {
                    "type": "function_call",
                    "call_id": "c1",
                    "name": "get_weather",
                    "arguments": '{"city": "Oslo"}',
                },
                {"type": "function_call_output", "call_id": "c1", "output": "-3 C, snow"},
            ],
            "tools": [{"type": "function", **_TOOL["function"]}],
        },
    ),
    (
        "messages",
        {
            "system": "You are terse.",
            "max_tokens": 16,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]}],
            "tools": [{"name": "get_weather", "input_schema": {"properties": {"city": {"type": "string"}}}}],
        },
    ),
]
"""What each model is checked with: plain chat, tools, a tool call with its result, and a completion."""


def _probe_image(w: int, h: int, colour: tuple[int, int, int]) -> str:
    """A small PNG as a ``data:`` URL (the probes' images: their size and bytes decide the ids)."""
    out = io.BytesIO()
    Image.new("RGB", (w, h), colour).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


_IMAGE_A = _probe_image(320, 200, (30, 90, 160))
_IMAGE_B = _probe_image(120, 480, (200, 120, 40))
MM_PROBE_SET: list[tuple[Kind, dict[str, Any]]] = [
    (
        "chat",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is on these two screens?"},
                        {"type": "image_url", "image_url": {"url": _IMAGE_A}},
                        {"type": "image_url", "image_url": {"url": _IMAGE_B}},
                    ],
                }
            ]
        },
    ),
    (
        "responses",
        {
            "input": [
                {
                    "type": "message",
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "Describe it."},
                        {"type": "input_image", "image_url": _IMAGE_A},
                    ],
                }
            ]
        },
    ),
]
"""Multimodal probes (route label ``<kind>+image``), for models whose processor the router reproduces:
chat on ``/tokenize`` (vLLM expands the images there too), Responses on its render route."""


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
            memo: Memo = {}
            for name in list(self.pool.upstreams):
                await self.check_instance(name, "startup", memo=memo)
        next_recheck = time.monotonic() + self.cfg.recheck_interval_s
        while True:
            for case in self.tracker.take():
                await self._check(case)
            back: Memo = {}
            while self._back:
                await self.check_instance(self._back.pop(), "startup", memo=back)
            if time.monotonic() >= next_recheck:
                next_recheck = time.monotonic() + self.cfg.recheck_interval_s
                for model in self.tracker.failing():
                    await self.recheck(model)
            await asyncio.sleep(self.poll_s)

    async def recheck(self, model: str | None) -> None:
        n = 0
        memo: Memo = {}
        for name, u in list(self.pool.upstreams.items()):
            if u.healthy and u.serves(model):
                # A probe the instance cannot answer (no instance left, a render route it does not serve)
                # is no evidence either way: the recheck passes on the probes it could check.
                results = await self.check_instance(name, "recheck", models=[model], memo=memo)
                n += sum(1 for r in results if r not in ("skipped", "unsupported"))
        self.tracker.recheck_done(model, n)

    # ------------------------------------------------------------------ checks
    async def probe_cases(
        self, model: str | None, reason: Reason, instance: str, memo: Memo | None = None
    ) -> list[ProbeCase]:
        """The probe set for ``model`` with the router's own ids (empty: no tokenizer for it).  ``memo``:
        the sets already made in this sweep of the fleet (the ids do not depend on the instance)."""
        if memo is not None and model in memo:
            return [msgspec.structs.replace(c, instance=instance) for c in memo[model]]
        out = []
        for kind, body in [*PROBE_SET, *MM_PROBE_SET]:
            raw = msgspec.json.encode({"model": model, **body} if model is not None else body)
            try:
                req = parse_body(raw, kind)
                ours = await self.pipeline.tokens.tokens(req)
            except ApiError:
                continue  # the model cannot render this probe (e.g. no tools in its template): skip it
            probe = probe_request(req)
            if ours is None or probe is None:
                continue
            path, body = probe
            route = f"{kind}+image" if req.media_paths else kind
            out.append(ProbeCase(model, body, [int(t) for t in ours], reason, instance, path, route))
        if memo is not None:
            memo[model] = out
        return out

    async def check_instance(
        self, name: str, reason: Reason, *, models: list[str | None] | None = None, memo: Memo | None = None
    ) -> list[str]:
        """Every probe of every model ``name`` serves (or of ``models``), on ``name``: the results."""
        return [r for _, r in await self.check_instance_detail(name, reason, models=models, memo=memo)]

    async def check_instance_detail(
        self, name: str, reason: Reason, *, models: list[str | None] | None = None, memo: Memo | None = None
    ) -> list[tuple[str, str]]:
        """``check_instance`` with each result's route (``chat``, ``chat+image``, ...)."""
        u = self.pool.upstreams.get(name)
        if u is None:
            return []
        # adapters render with their base model's tokenizer and template: checked through the base model
        bases = [m for m in u.cfg.models or u.served_models if m not in u.adapters]
        served: list[str | None] = list(bases) or [None]
        wanted = models if models is not None else served
        results = []
        for model in wanted:
            for case in await self.probe_cases(model, reason, name, memo):
                results.append((case.route, await self._check(case)))
        return results

    async def _check(self, case: ProbeCase) -> str:
        name = case.instance if case.instance in self.pool.upstreams else None
        if name is None:
            name = next(
                (n for n, u in self.pool.upstreams.items() if u.healthy and u.serves(case.model)), None
            )
        if name is None:
            return "skipped"
        theirs = await self.tokenize(name, case.body, case.path)
        method = "tokenize" if case.path == "/tokenize" else "render"
        if theirs is _UNSUPPORTED:
            self.tracker.unsupported(case)
            self.pipeline.metrics.parity_checks.labels(
                str(case.model), case.route, method, "unsupported"
            ).inc()
            return "unsupported"
        result = self.tracker.record(
            case, theirs if isinstance(theirs, list) else None, name, time.monotonic()
        )
        self.pipeline.metrics.parity_checks.labels(str(case.model), case.route, method, result).inc()
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

    async def tokenize(self, name: str, body: dict[str, Any], path: str = "/tokenize") -> list[int] | object:
        """The instance's token ids for ``body`` at ``path`` (None when it could not answer;
        ``_UNSUPPORTED`` when it does not serve that render route)."""
        if self.session is None:
            return None
        try:
            async with self.session.post(
                self.pool.url(name) + path,
                json=body,
                timeout=aiohttp.ClientTimeout(total=self.cfg.timeout_s),
            ) as r:
                if r.status in _NOT_SERVED and path in RENDER_PATHS.values():
                    return _UNSUPPORTED
                if r.status != 200:
                    return None
                got = msgspec.json.decode(await r.read())
        except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError, KeyError):
            return None
        key = "tokens" if path == "/tokenize" else "token_ids"
        tokens = got.get(key) if isinstance(got, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            return None
        return tokens
