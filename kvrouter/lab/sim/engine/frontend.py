"""``FrontEnd``: vLLM's API server in front of one simulated engine, per request, on the caller's clock.

::

    arrive(now) ─ http_request ─▶ renderer worker (FIFO) ─ render(api, tokens) ─ to_engine ─▶ engine
    engine output ─ first_output(tokens) / next_output ─ http_response ─▶ client

Costs come from the profile's ``timing.FrontendCosts``.  Only the render occupies something: the renderer's
worker threads (vLLM's ``--renderer-num-workers``, default one), taken in arrival order, so a burst of long
prompts waits for each other's tokenization; everything else is latency.  Pure and clock-agnostic like the
engine: the live shell passes its event loop's time, the evaluator its virtual time, and both get back when
the engine core has the request.  Durations are divided by ``speed``, as the engine's steps are.
"""

from __future__ import annotations

import heapq

from kvrouter.lab.sim.engine.timing import FrontendCosts, PromptApi
from kvrouter.lab.sim.errors import SimConfigError


class FrontEnd:
    """The API server of one simulated instance (or rank).  Single owner, like the engine."""

    def __init__(self, costs: FrontendCosts, *, speed: float = 1.0, workers: int | None = None) -> None:
        """``workers``: renderer threads (default: ``costs.renderer_workers``); a pooled engine standing
        for N instances has N times as many."""
        if speed <= 0:
            raise SimConfigError("speed must be positive")
        costs.validate()
        n = costs.renderer_workers if workers is None else workers
        if n < 1:
            raise SimConfigError("a front end needs at least one renderer worker")
        self.costs = costs
        self.speed = speed
        self.workers = n
        self._free_at = [float("-inf")] * n
        """When each worker is next free (a heap: the earliest first)."""
        self.rendered = 0
        self.queued_s = 0.0
        """Total time requests waited for a worker (how busy the front end ran)."""

    def arrive(self, now: float, num_prompt_tokens: int, api: PromptApi) -> float:
        """A request reaches the API server at ``now``; returns when the engine core has it.  Calls must
        come in arrival order (each takes the earliest free worker)."""
        c, speed = self.costs, self.speed
        at_renderer = now + c.http_request_s / speed
        start = max(at_renderer, self._free_at[0])
        done = start + c.render_s(api, num_prompt_tokens) / speed
        heapq.heapreplace(self._free_at, done)
        self.rendered += 1
        self.queued_s += start - at_renderer
        return done + c.to_engine.at(num_prompt_tokens) / speed

    def first_output_delay(self, num_prompt_tokens: int) -> float:
        """From the engine step that produced a request's first token to the client having it."""
        return self.costs.first_output_s(num_prompt_tokens) / self.speed

    def output_delay(self) -> float:
        """The same for every later output of a request."""
        return self.costs.output_s() / self.speed

    def delay(self, first: bool, num_prompt_tokens: int) -> float:
        """``first_output_delay`` or ``output_delay``."""
        return self.first_output_delay(num_prompt_tokens) if first else self.output_delay()
