"""What every synthetic generator shares: common parameters, stream keys, prompt rendering, assembly.

A generator describes each prompt as *parts*, ``(role, segment)`` pairs, and the renderer turns them into
the requested form::

    parts  = [("system", Segment(k_sys, 2048)), ("user", Segment(k_q, 128))]
    tokens -> segments = (k_sys:2048, k_q:128)                  num_prompt_tokens = 2176
    text   -> text     = "<2048 words>\\n\\n<128 words>"          (estimate: 2176)
    chat   -> messages = [system: "<2048 words>", user: "<128 words>"]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
from msgspec import Struct

from kvrouter.lab.workloads.arrivals import (
    AllAtOnce,
    Arrival,
    arrival_times,
    mode_of,
    request_count,
    sort_requests,
)
from kvrouter.lab.workloads.spec import Request, Role, Segment, TokenSpace, Workload, plain
from kvrouter.lab.workloads.text import TextCache, render_messages, render_text
from kvrouter.lab.workloads.tokens import derive_key

PromptForm = Literal["tokens", "text", "chat"]
Parts = Sequence[tuple[Role, Segment]]


class GeneratorParams(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Parameters every synthetic generator takes."""

    seed: int = 0
    """Seeds content and every random choice; same seed and parameters, same workload."""
    form: PromptForm = "tokens"
    """``tokens``: lazy token ids (simulation); ``text``/``chat``: prompt text or chat messages for the
    live path (``materialize`` them with the served model's tokenizer to simulate them too)."""
    token_space: TokenSpace = TokenSpace()
    """Token ids the synthetic streams draw from (tokens form)."""
    num_requests: int | None = None
    """Number of requests; None: the workload's natural size, or as many as a staged schedule yields."""
    arrival: Arrival = AllAtOnce()
    """When requests are sent (each generator sets its peers' default)."""


class Keys:
    """Stream keys of one generator run: ``keys("system", 3)`` names the 4th group's system prompt."""

    def __init__(self, seed: int, namespace: str) -> None:
        self.seed = seed
        self.namespace = namespace

    def __call__(self, *labels: str | int) -> int:
        return derive_key(self.seed, self.namespace, *labels)

    def segment(self, length: int, *labels: str | int) -> Segment:
        return Segment(self(*labels), length)


class Renderer:
    """Turns parts into a request's prompt fields in one form; caches segment texts for the run."""

    def __init__(self, form: PromptForm) -> None:
        self.form = form
        self._texts = TextCache()

    def fields(self, parts: Parts) -> dict[str, Any]:
        n = sum(seg.length for _, seg in parts)
        match self.form:
            case "tokens":
                return {"segments": tuple(seg for _, seg in parts), "num_prompt_tokens": n}
            case "text":
                return {"text": render_text(parts, self._texts), "num_prompt_tokens": n}
            case "chat":
                return {"messages": render_messages(parts, self._texts), "num_prompt_tokens": n}
        raise AssertionError(f"unknown form {self.form!r}")

    def outputs(self, segments: tuple[Segment, ...]) -> tuple[Segment, ...]:
        """Output segments are only meaningful to a token-level engine model."""
        return segments if self.form == "tokens" else ()


def rng_for(params: GeneratorParams, stream: str) -> np.random.Generator:
    """An independent generator per purpose, so that e.g. changing the arrival process leaves the
    prompt order unchanged."""
    return np.random.default_rng([params.seed & (2**63 - 1), derive_key(0, stream) & (2**63 - 1)])


def assemble(
    name: str,
    params: GeneratorParams,
    requests: list[Request],
    hints: Mapping[str, Any] | None = None,
) -> Workload:
    """The workload, sorted into release order, with its parameters recorded.

    ``hints`` are settings meant for the evaluator (e.g. the peer's instance count); the registry fills
    them in for the workloads it names."""
    return Workload(
        name=name,
        requests=sort_requests(requests),
        mode=mode_of(params.arrival),
        token_space=params.token_space,
        metadata={"generator": name, "params": plain(params), "hints": dict(hints or {})},
    )


def schedule(params: GeneratorParams, natural: int) -> list[float | None]:
    """One arrival time per request to build (None each in closed loop); its length is the count."""
    n = request_count(params.arrival, params.num_requests, natural)
    times = arrival_times(params.arrival, n, rng_for(params, "arrival"))
    if times is None:
        return [None] * (n or 0)
    return list(times)
