"""One data-parallel rank of a live simulated instance: an ``Engine`` stepped in real time, its publisher,
and the output channel of every request in it.

::

    submit() ──▶ Engine.add_request ──▶ wake
                                          │
    run():  idle ──(wake)──▶ step() ──▶ sleep(duration x slowdown) ──▶ publish(events) ──▶ deliver outputs
              ▲                                                                               │
              └──────────────────────────────── no work left ◀───────────────────────────────┘

The engine is pure; this loop is its only caller besides ``submit``/``abort``/``crash`` (all on the same
event loop, none awaits in the middle of an engine call), so engine state has one owner.  A step's events
and outputs are released when its modelled duration has passed, as vLLM publishes after the forward pass.
Steps are laid end to end on a running clock, so the time spent delivering outputs is absorbed by the
next step's duration instead of accumulating as drift.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence

from kvrouter.lab.sim.engine.engine import Engine
from kvrouter.lab.sim.engine.scheduler import KvLoad, RequestOutput
from kvrouter.lab.sim.server.faults import FaultState
from kvrouter.lab.sim.server.publisher import EventPublisher

log = logging.getLogger("kvrouter.lab.sim.server.rank")

_CATCH_UP_S = 0.05
"""A step starts where the previous one ended unless that is further back than this (the engine idled)."""
_STALL_POLL_S = 0.02
"""How often a stalled loop checks whether the stall is over (only while stalled)."""


class Crashed:
    """Delivered to every open request channel when the engine dies (the request is lost)."""


CRASHED = Crashed()

Item = RequestOutput | Crashed
Stamped = tuple[float, Item]
"""An item and when the rank released it (``time.monotonic()``): the API server's way back starts there."""


class EngineRank:
    """A rank's engine, publisher and step loop.  ``start()`` launches the loop, ``stop()`` cancels it."""

    def __init__(
        self, rank: int, engine: Engine, publisher: EventPublisher | None, faults: FaultState
    ) -> None:
        self.rank = rank
        self.engine = engine
        self.publisher = publisher
        self.faults = faults
        self._channels: dict[str, asyncio.Queue[Stamped]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._epoch = 0
        """Bumped by ``crash()``: a step in flight across a crash died with the engine."""
        self._clock = 0.0
        self.steps = 0
        self.step_starts: deque[float] = deque(maxlen=256)
        """``time.monotonic()`` when each recent step began, oldest first (what a stall held back)."""
        self.stall_waits = 0
        """Times the loop found work and held it for a stall (``faults.stall_s``)."""
        self.on_loads: Callable[[EngineRank, list[KvLoad]], None] | None = None
        """Called after a step that admitted decode legs with transfers to run (the KV connector)."""

    # ------------------------------------------------------------------ requests
    def submit(
        self,
        request_id: str,
        prompt: Sequence[int],
        max_tokens: int,
        *,
        output_token_ids: Sequence[int],
        cache_salt: str | None = None,
        lora_name: str | None = None,
        hold_blocks: bool = False,
        remote_prefill_tokens: int | None = None,
        mm_items: Sequence[tuple[str, int, int]] = (),
    ) -> asyncio.Queue[Stamped]:
        """Queue a request; its outputs arrive on the returned channel, each with the time it was released.
        Raises ``RequestRejected``."""
        self.engine.add_request(
            request_id,
            prompt,
            max_tokens,
            cache_salt=cache_salt,
            lora_name=lora_name,
            output_token_ids=output_token_ids,
            hold_blocks=hold_blocks,
            remote_prefill_tokens=remote_prefill_tokens,
            mm_items=mm_items,
        )
        q: asyncio.Queue[Stamped] = asyncio.Queue()
        self._channels[request_id] = q
        self._wake.set()
        return q

    def abort(self, request_id: str) -> bool:
        """Forget a request (client gone): its blocks are freed, nothing more is delivered."""
        self._channels.pop(request_id, None)
        return self.engine.abort(request_id)

    def load(self) -> int:
        """vLLM's data-parallel balancing score: waiting x 4 + running."""
        s = self.engine.scheduler
        return (len(s.waiting) + len(s.holding)) * 4 + len(s.running)

    @property
    def in_flight(self) -> int:
        return len(self._channels)

    @property
    def epoch(self) -> int:
        """Bumped by every crash: work started before it must not touch the engine after it."""
        return self._epoch

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"sim-rank-{self.rank}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._fail_all()

    def crash(self) -> int:
        """The engine dies: every request is lost (its channel gets ``CRASHED``), the cache is empty.
        Returns how many requests were lost.  The publisher is the caller's (it crashes with the process)."""
        self._epoch += 1
        lost = self.engine.restart()
        self._fail_all()
        return len(lost)

    def _fail_all(self) -> None:
        channels, self._channels = self._channels, {}
        now = time.monotonic()
        for q in channels.values():
            q.put_nowait((now, CRASHED))

    def wake(self) -> None:
        self._wake.set()

    # ------------------------------------------------------------------ the loop
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        engine, faults = self.engine, self.faults
        while True:
            # Events queued between steps (reset_prefix_cache's AllBlocksCleared) stay queued and go out
            # first in the next step's batch, as in vLLM, whose idle engine runs no step and so publishes
            # nothing (EngineCore.step returns early without requests): a router that starts after a
            # reset and before traffic still holds the blocks the engine dropped.
            if not engine.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            stall = faults.stall_left()
            if stall > 0:
                self.stall_waits += 1
                await asyncio.sleep(min(stall, _STALL_POLL_S))
                continue
            epoch = self._epoch
            now = loop.time()
            start = self._clock if self._clock >= now - _CATCH_UP_S else now
            self.step_starts.append(time.monotonic())
            result = engine.step()
            events = engine.take_events()
            self._clock = start + result.duration_s * faults.slowdown
            delay = self._clock - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                await asyncio.sleep(0)  # never starve the HTTP side, even when lagging
            if epoch != self._epoch:
                continue  # crashed during the step: its events and tokens died with the engine
            if result.num_scheduled:
                self.steps += 1
            if events and self.publisher is not None:
                self.publisher.publish(events)
            loads = engine.take_loads()
            if loads and self.on_loads is not None:
                self.on_loads(self, loads)
            self._deliver(result.outputs)
            if not (result.num_scheduled or result.loaded_tokens) and engine.has_work():
                # Nothing fitted this step (all waiting, no blocks): do not spin.
                await asyncio.sleep(_STALL_POLL_S)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        channels = self._channels
        now = time.monotonic()
        for out in outputs:
            q = channels.get(out.request_id)
            if q is None:
                continue  # aborted after it was scheduled
            q.put_nowait((now, out))
            if out.finished:
                del channels[out.request_id]
