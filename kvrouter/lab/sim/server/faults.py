"""Fault injection for a simulated instance: ``FaultConfig`` at start (CLI, SimFleetConfig), ``FaultUpdate``
at run time (``POST /sim/faults``), into one ``FaultState`` per instance read by the HTTP handlers and
every rank's step loop.  Knobs and what a router sees:

``drop_rate``       a fraction of KV-event batches never reach subscribers (still replayable: a gap)
``dead``            ``/health`` and the OpenAI routes answer 503 (the engine is dead, the server is up)
``latency_s``       every OpenAI request waits this long before it reaches the engine
``slowdown``        every engine step takes this many times longer (< 1 is faster)
``stall_s``         the engines stop stepping for this long (0 resumes): streams freeze, no events
``stall_events``    the publishers hold their batches until set false (then flush in order)
``corrupt_next``    the next n batches of every rank are undecodable
``mute_replay``     replay requests are swallowed (a replay that never answers)
``render_fault``    chat and /tokenize render with another template: token ids differ from the router's
``crash``           the process dies: port closed, in-flight requests cut, caches and event sequences
                    lost; after ``down_s`` it is back, empty
"""

from __future__ import annotations

import time

import msgspec

from kvrouter.lab.sim.errors import SimConfigError


def _check_rate(v: float) -> None:
    if not 0.0 <= v <= 1.0:
        raise SimConfigError("drop_rate must be in [0, 1]")


class FaultConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Faults an instance starts with."""

    drop_rate: float = 0.0
    """Fraction of KV-event batches dropped before subscribers (they stay replayable)."""
    dead: bool = False
    """Answer 503 on /health and the OpenAI routes."""
    latency_s: float = 0.0
    """Added delay before each OpenAI request reaches the engine."""
    slowdown: float = 1.0
    """Multiplier of every step's modelled duration."""
    stall_s: float = 0.0
    """The engines do not step for this long after start."""
    render_fault: bool = False
    """Render chats with another template than the fleet's (a misconfigured instance)."""

    def validate(self) -> None:
        _check_rate(self.drop_rate)
        if self.latency_s < 0 or self.stall_s < 0:
            raise SimConfigError("latency_s and stall_s must be >= 0")
        if self.slowdown <= 0:
            raise SimConfigError("slowdown must be positive")


class FaultUpdate(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Body of ``POST /sim/faults``: fields left out (null) keep their current value."""

    drop_rate: float | None = None
    """New drop fraction for every rank's publisher."""
    dead: bool | None = None
    """503 on /health and the OpenAI routes (true) or back to normal (false)."""
    latency_s: float | None = None
    """Added delay per OpenAI request."""
    slowdown: float | None = None
    """Step duration multiplier."""
    stall_s: float | None = None
    """Stop stepping for this long from now; 0 resumes at once."""
    stall_events: bool | None = None
    """Hold (true) or release (false) every rank's event batches."""
    corrupt_next: int | None = None
    """Make the next n batches of every rank undecodable."""
    mute_replay: bool | None = None
    """Swallow replay requests."""
    render_fault: bool | None = None
    """Render chats with another template (true) or the fleet's again (false)."""
    crash: bool = False
    """Crash now; the instance comes back empty after ``down_s``."""
    down_s: float = 0.5
    """How long a crashed instance stays down (its port closed)."""

    def validate(self) -> None:
        if self.drop_rate is not None:
            _check_rate(self.drop_rate)
        for name in ("latency_s", "stall_s"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise SimConfigError(f"{name} must be >= 0")
        if self.slowdown is not None and self.slowdown <= 0:
            raise SimConfigError("slowdown must be positive")
        if self.corrupt_next is not None and self.corrupt_next < 0:
            raise SimConfigError("corrupt_next must be >= 0")
        if self.down_s < 0:
            raise SimConfigError("down_s must be >= 0")


class FaultStatus(msgspec.Struct, frozen=True):
    """Answer of ``GET``/``POST /sim/faults``."""

    drop_rate: float
    """Fraction of event batches dropped."""
    dead: bool
    """/health and the OpenAI routes answer 503."""
    latency_s: float
    """Added delay per OpenAI request."""
    slowdown: float
    """Step duration multiplier."""
    stalled_for_s: float
    """Seconds of engine stall left (0: stepping)."""
    stall_events: bool
    """Publishers hold their batches."""
    mute_replay: bool
    """Replay requests are swallowed."""
    render_fault: bool
    """Chats are rendered with another template than the fleet's."""
    crashed: bool
    """The instance is down after a crash (only visible in-process: its port is closed)."""
    crashes: int
    """Crashes so far."""


class FaultState:
    """The instance's current faults.  Mutated only by the instance (one event loop, no locks needed).

    ``stall_until`` is on ``time.monotonic()``'s clock, like ``asyncio``'s default loop clock."""

    def __init__(self, config: FaultConfig) -> None:
        config.validate()
        self.drop_rate = config.drop_rate
        self.dead = config.dead
        self.latency_s = config.latency_s
        self.slowdown = config.slowdown
        self.stall_until = time.monotonic() + config.stall_s if config.stall_s else 0.0
        self.stall_events = False
        self.mute_replay = False
        self.render_fault = config.render_fault
        self.crashed = False
        self.crashes = 0

    def stall_left(self) -> float:
        if not self.stall_until:
            return 0.0
        left = self.stall_until - time.monotonic()
        if left <= 0:
            self.stall_until = 0.0
            return 0.0
        return left

    def stall(self, seconds: float) -> None:
        self.stall_until = time.monotonic() + seconds if seconds > 0 else 0.0

    def status(self) -> FaultStatus:
        return FaultStatus(
            drop_rate=self.drop_rate,
            dead=self.dead,
            latency_s=self.latency_s,
            slowdown=self.slowdown,
            stalled_for_s=round(self.stall_left(), 3),
            stall_events=self.stall_events,
            mute_replay=self.mute_replay,
            render_fault=self.render_fault,
            crashed=self.crashed,
            crashes=self.crashes,
        )
