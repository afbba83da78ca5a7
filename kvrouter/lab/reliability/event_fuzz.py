"""Fuzzing the event decoder and the index: hostile payloads on one source, a control source beside it.

::

    HostilePayloads ──apply_payload("fuzz", p)──▶ Indexer ◀──apply_payload("control", p)── sim Engine
                      per payload: no exception, time, counters before/after      (every N payloads)
    end: the control source's index equals its engine's cache, block for block; its trust is exact

Accounting (checked per payload): a payload is either one decode error (nothing applied), or every event in
its ``events`` array is applied, rejected with a per-event reason (``event_errors``), or skipped by the
decoder with a reason (``skipped_events``).  Per-hash reasons (``unknown_removed_block``,
``unknown_offload_block``) and ``other_group`` belong to events that were applied, so they stay out of the
sum.  A payload whose events cannot be counted independently (it does not decode as plain msgpack) is only
checked for "something was counted".
"""

from __future__ import annotations

import random
import time
from collections import Counter

import msgspec
import numpy as np

from indexer import Indexer, SourceKey, Trust
from kvrouter.lab.reliability.figures import Figure, ScenarioResult, at_most, exactly, fig
from kvrouter.lab.reliability.payloads import HostilePayloads
from kvrouter.lab.sim.engine import CacheConfig, Engine, EngineConfig, SchedulerConfig
from kvrouter.lab.sim.engine.payload import PayloadWriter
from kvrouter.percentiles import quantile

_PER_HASH = frozenset({"unknown_removed_block", "unknown_offload_block"})
_APPLIED_SKIPS = frozenset({"other_group"})
_ANY = msgspec.msgpack.Decoder()


class EventFuzzConfig(msgspec.Struct, frozen=True):
    payloads: int = 100_000
    """Hostile and valid-looking payloads applied to the fuzzed source."""
    seed: int = 0
    block_size: int = 16
    control_every: int = 40
    """One engine step of the control source is applied after this many fuzz payloads."""
    max_blocks_per_source: int = 100_000
    """Cap per source: the fuzzed source's blocks may not grow past it (refusals are counted)."""
    slow_payload_s: float = 1.0
    """A payload taking longer than this counts as a hang."""
    huge_every: int = 4000
    """One payload in this many is huge (hundreds of thousands of block hashes)."""


class EventFuzzReport(msgspec.Struct):
    payloads: int = 0
    families: Counter[str] = msgspec.field(default_factory=Counter)
    crashes: list[str] = []
    uncounted: list[str] = []
    """Payloads whose events were not all applied or counted under a reason."""
    wrong_reason: list[str] = []
    """Crafted payloads not counted under the reason they were made to trigger."""
    slow: int = 0
    max_s: float = 0.0
    p99_us: float = 0.0
    p50_us: float = 0.0
    rejections: dict[str, int] = {}
    control_batches: int = 0
    control_errors: int = 0
    """Control batches with anything rejected, or fewer events applied than sent."""
    control_mismatches: int = 0
    """Control prompts whose indexed depth differs from the engine's cache at the end."""
    control_prompts: int = 0
    control_trust: str = ""
    sources: int = 0
    fuzz_blocks: int = 0
    wall_s: float = 0.0


def _raw_event_count(payload: bytes) -> int | None:
    """How many events the payload's ``events`` array holds, read as plain msgpack (None: unreadable)."""
    try:
        obj = _ANY.decode(payload)
    except (msgspec.DecodeError, RecursionError, TypeError, ValueError):
        return None
    events = None
    if isinstance(obj, list) and len(obj) >= 2:
        events = obj[1]
    elif isinstance(obj, dict):
        events = obj.get("events")
    return len(events) if isinstance(events, list) else None


class _Totals(msgspec.Struct):
    decode: Counter[str]
    event: Counter[str]
    skipped: Counter[str]


def _totals(ix: Indexer) -> _Totals:
    c = ix.counters
    return _Totals(Counter(c.decode_errors), Counter(c.event_errors), Counter(c.skipped_events))


def _delta(a: Counter[str], b: Counter[str]) -> Counter[str]:
    return Counter({k: v - a.get(k, 0) for k, v in b.items() if v != a.get(k, 0)})


class _Control:
    """A simulated engine's real event stream: the source the fuzz must not disturb."""

    def __init__(self, rng: random.Random, block_size: int) -> None:
        self.rng = rng
        self.engine = Engine(
            EngineConfig(
                cache=CacheConfig(block_size=block_size, num_gpu_blocks=256),
                scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256),
            )
        )
        self.writer = PayloadWriter("0.33.0")
        self.bases = [[rng.randrange(1, 30_000) for _ in range(300)] for _ in range(6)]
        self.prompts: list[list[int]] = []
        self._n = 0
        self._ts = 1.7e9

    def step(self) -> tuple[bytes, int] | None:
        """One engine step's payload and its event count (None when the step emitted nothing)."""
        r, e = self.rng, self.engine
        if not e.has_work() or r.random() < 0.3:
            prompt = [*r.choice(self.bases)[: r.randrange(20, 300)], r.randrange(1, 30_000)]
            self.prompts.append(prompt)
            self._n += 1
            e.add_request(f"c{self._n}", prompt, r.randrange(1, 24))
        e.step()
        events = e.take_events()
        if not events:
            return None
        self._ts += 0.01
        return self.writer.payload(events, self._ts), len(events)

    def drain(self) -> list[tuple[bytes, int]]:
        out = []
        while self.engine.has_work():
            self.engine.step()
            events = self.engine.take_events()
            if events:
                self._ts += 0.01
                out.append((self.writer.payload(events, self._ts), len(events)))
        return out

    def engine_hashes(self) -> list[int]:
        return [int(h) for h in self.engine.pool.cached_hashes()]


def run_event_fuzz(cfg: EventFuzzConfig) -> EventFuzzReport:
    """Apply ``cfg.payloads`` hostile payloads with a control source interleaved; never raises."""
    rng = random.Random(cfg.seed)
    ix = Indexer(cfg.block_size, max_blocks_per_source=cfg.max_blocks_per_source)
    gen = HostilePayloads(random.Random(cfg.seed + 1), cfg.block_size, huge_every=cfg.huge_every)
    control = _Control(random.Random(cfg.seed + 2), cfg.block_size)
    rep = EventFuzzReport()
    times = np.empty(cfg.payloads, dtype=np.float64)
    t_start = time.perf_counter()

    def apply_control(payload: bytes, n_events: int) -> None:
        before = _totals(ix)
        applied = ix.apply_payload("control", payload)
        after = _totals(ix)
        rep.control_batches += 1
        bad = _delta(before.decode, after.decode) or _delta(before.event, after.event)
        if bad or applied != n_events:
            rep.control_errors += 1

    for i in range(cfg.payloads):
        s = gen.next()
        rep.families[s.family] += 1
        before = _totals(ix)
        t0 = time.perf_counter()
        try:
            applied = ix.apply_payload("fuzz", s.payload)
        except Exception as e:  # the property under test: nothing may escape
            times[i] = time.perf_counter() - t0
            what = f"{type(e).__name__}: {str(e)[:80]}"
            rep.crashes.append(f"{s.family}: {what} payload={s.payload[:48].hex()}")
            continue
        times[i] = dt = time.perf_counter() - t0
        if dt > cfg.slow_payload_s:
            rep.slow += 1
        after = _totals(ix)
        problem = _check_accounting(s.payload, applied, before, after)
        if problem:
            rep.uncounted.append(f"{s.family}: {problem} payload={s.payload[:48].hex()}")
        if s.expect:
            seen = set(_delta(before.decode, after.decode)) | set(_delta(before.event, after.event))
            seen |= set(_delta(before.skipped, after.skipped))
            if not seen & s.expect:
                rep.wrong_reason.append(f"{s.family}: expected {sorted(s.expect)}, counted {sorted(seen)}")
        if i % cfg.control_every == 0:
            step = control.step()
            if step is not None:
                apply_control(*step)
                if rng.random() < 0.1:
                    gen.foreign = control.engine_hashes()
    for payload, n in control.drain():
        apply_control(payload, n)
    rep.payloads = cfg.payloads
    rep.wall_s = time.perf_counter() - t_start
    rep.max_s = float(times.max()) if cfg.payloads else 0.0
    rep.p99_us = quantile(times.tolist(), 0.99) * 1e6 if cfg.payloads else 0.0
    rep.p50_us = quantile(times.tolist(), 0.5) * 1e6 if cfg.payloads else 0.0
    c = ix.counters
    rejections: Counter[str] = Counter()
    for k, v in c.decode_errors.items():
        rejections[f"decode:{k}"] += v
    for k, v in c.event_errors.items():
        rejections[f"event:{k}"] += v
    for k, v in c.skipped_events.items():
        rejections[f"skipped:{k}"] += v
    rep.rejections = dict(rejections)
    ctl = SourceKey("control", 0)
    rep.control_trust = ix.trust(ctl).value
    rep.control_prompts = len(control.prompts)
    for tokens in control.prompts:
        got = next((m.matched_blocks for m in ix.lookup(tokens).instances if m.instance == "control"), 0)
        if got != control.engine.cached_prefix_blocks(tokens):
            rep.control_mismatches += 1
    rep.sources = len(ix.sources())
    rep.fuzz_blocks = sum(sum(ix.index.blocks(s).values()) for s in ix.sources() if s.instance == "fuzz")
    return rep


def _check_accounting(payload: bytes, applied: int, before: _Totals, after: _Totals) -> str | None:
    dec = sum(_delta(before.decode, after.decode).values())
    ev = _delta(before.event, after.event)
    sk = _delta(before.skipped, after.skipped)
    if dec:
        if dec != 1 or applied or ev or sk:
            return f"decode error counted {dec}x with {applied} applied"
        return None
    n = _raw_event_count(payload)
    per_event = sum(v for k, v in ev.items() if k not in _PER_HASH)
    skipped = sum(v for k, v in sk.items() if k not in _APPLIED_SKIPS)
    if n is None:
        return None if applied or per_event or skipped else "nothing applied and nothing counted"
    if n != applied + per_event + skipped:
        return f"{n} events: {applied} applied + {per_event} rejected + {skipped} skipped"
    return None


def event_fuzz_result(cfg: EventFuzzConfig) -> ScenarioResult:
    """The scenario: figures of one fuzz run."""
    t0 = time.perf_counter()
    rep = run_event_fuzz(cfg)
    figures: list[Figure] = [
        fig("payloads (families)", rep.payloads, fmt="{:,}"),
        exactly("exceptions escaping apply_payload", len(rep.crashes), 0),
        exactly("payloads not fully counted by reason", len(rep.uncounted), 0),
        exactly("crafted payloads counted under another reason", len(rep.wrong_reason), 0),
        at_most("slowest payload", rep.max_s * 1e3, cfg.slow_payload_s * 1e3, unit="ms", fmt="{:.1f}"),
        fig("apply time p50 / p99", f"{rep.p50_us:.0f} / {rep.p99_us:.0f} us"),
        fig("rejections by reason", rep.rejections),
        exactly("control batches with a rejection", rep.control_errors, 0),
        exactly(
            f"control prompts off its engine's cache (of {rep.control_prompts})", rep.control_mismatches, 0
        ),
        exactly("control source trust", rep.control_trust, Trust.EXACT.value),
        at_most("fuzzed source blocks (cap)", rep.fuzz_blocks, cfg.max_blocks_per_source, fmt="{:,}"),
    ]
    notes = [*rep.crashes[:3], *rep.uncounted[:3], *rep.wrong_reason[:3]]
    return ScenarioResult(
        "event-fuzz",
        "Bad input",
        f"Event decoder + index fuzz, {rep.payloads:,} payloads",
        figures,
        time.perf_counter() - t0,
        notes=notes,
    )
