"""The KV-event publisher of one simulated engine (one data-parallel rank), as vLLM's ``ZmqEventPublisher``.

::

    engine.step(); engine.take_events() ──▶ publish(events, ts)        one batch per non-empty step
                                               │ seq = 0, 1, 2 ...      (per publisher; restart -> 0)
                                               ├──▶ PUB   [topic, seq8, payload]     bind (or connect) at
                                               │                                      endpoint + dp_rank
                                               └──▶ replay buffer (last buffer_steps batches)
    DEALER [b"", start8] ──▶ ROUTER (replay_endpoint + dp_rank)
                         ◀── [b"", seq8, payload] ...  [b"", END, b""]              releases <= 0.25
                         ◀── [b"", topic, seq8, payload] ...  [b"", b"", END, b""]  releases >= 0.26

Payloads are written by ``payload.PayloadWriter`` (``indexer.encode.PayloadEncoder``): any release's shape.

Fault knobs (for tests and demos; each says what a router then sees):

* ``drop_rate``: a fraction of batches never reaches subscribers (seeded RNG).  A dropped batch still
  takes its sequence number and stays in the replay buffer, exactly like a ZeroMQ high-water-mark drop:
  subscribers see a gap and can replay it.
* ``stall()`` / ``resume()``: batches are held (not sent, not yet replayable) and flushed in order on
  resume, like a publisher thread that fell behind.
* ``crash()`` / ``restart()``: sockets close (subscribers see the peer go), the buffer and held batches
  are lost, publishing is refused while down; on restart the sequence starts again at 0.
* ``mute_replay``: the ROUTER swallows replay requests (a replay that never answers).
* ``corrupt_next(n)``: the next n batches carry an undecodable payload (a "poison pill").

Sockets close with ``linger=0``; ``stop()`` leaves nothing running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import deque
from collections.abc import Sequence

import msgspec
import zmq
import zmq.asyncio

from indexer.config import offset_endpoint
from indexer.encode import RELEASES, version_tuple
from kvrouter.lab.sim.engine.events import KVEvent
from kvrouter.lab.sim.engine.payload import PayloadWriter
from kvrouter.lab.sim.errors import PublisherError, SimConfigError

log = logging.getLogger("kvrouter.lab.sim.server.publisher")

END_SEQ = b"\xff" * 8
"""The replay end marker's sequence field."""


def topic_for(instance: str, model: str) -> str:
    """The topic an instance publishes under in bind mode: ``kv@<instance>@<model>``."""
    return f"kv@{instance}@{model}"


async def _bind(sock: zmq.Socket[bytes] | zmq.asyncio.Socket, endpoint: str, retry_s: float) -> None:
    deadline = time.monotonic() + retry_s
    while True:
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as e:
            if e.errno != zmq.EADDRINUSE or time.monotonic() >= deadline:
                raise
        await asyncio.sleep(0.05)


class PublisherConfig(msgspec.Struct, frozen=True):
    endpoint: str = "tcp://127.0.0.1:5557"
    """PUB endpoint of data-parallel rank 0; rank r uses port + r (``indexer.config.offset_endpoint``)."""
    replay_endpoint: str | None = None
    """ROUTER endpoint for replay (always bound, offset by rank like the PUB); None: no replay."""
    connect: bool = False
    """Connect the PUB to a bound SUB (the indexer's bind mode) instead of binding it."""
    topic: str = ""
    """Frame 0 of every message (vLLM's ``topic``); ``topic_for(instance, model)`` in bind mode."""
    release: str = "0.33.0"
    """vLLM release whose wire shape the payloads take (``indexer.encode.RELEASES``)."""
    dp_rank: int = 0
    """Data-parallel rank: written into each batch and added to the ports."""
    buffer_steps: int = 10000
    """Batches kept for replay (vLLM's default)."""
    hwm: int = 100000
    """PUB send high-water mark (vLLM's default)."""
    drop_rate: float = 0.0
    """Fault: fraction of batches dropped before subscribers (still replayable)."""
    seed: int = 0
    """Seed of the drop RNG."""

    def validate(self) -> None:
        if self.release not in RELEASES:
            raise SimConfigError(f"unknown vLLM release {self.release!r}")
        if self.dp_rank < 0:
            raise SimConfigError("dp_rank must be >= 0")
        if self.buffer_steps < 1:
            raise SimConfigError("buffer_steps must be >= 1")
        if not 0.0 <= self.drop_rate <= 1.0:
            raise SimConfigError("drop_rate must be in [0, 1]")
        for ep in (self.endpoint, self.replay_endpoint):
            if ep is not None and not ep.startswith(("tcp://", "ipc://", "inproc://")):
                raise SimConfigError(f"bad ZeroMQ endpoint {ep!r}")

    @property
    def pub_endpoint(self) -> str:
        return offset_endpoint(self.endpoint, self.dp_rank)

    @property
    def router_endpoint(self) -> str | None:
        return None if self.replay_endpoint is None else offset_endpoint(self.replay_endpoint, self.dp_rank)


class PublisherStats(msgspec.Struct):
    batches: int = 0
    """Sequence numbers assigned (sent, dropped or held)."""
    sent: int = 0
    dropped: int = 0
    """Batches the drop fault swallowed."""
    corrupted: int = 0
    refused: int = 0
    """Batches offered while crashed (lost with the engine)."""
    replay_requests: int = 0
    replayed_batches: int = 0


class EventPublisher:
    """One rank's PUB socket, replay ROUTER and fault knobs.  ``publish`` is synchronous (a PUB never
    blocks); the ROUTER is served by a task between ``start()`` and ``stop()``."""

    def __init__(self, config: PublisherConfig, *, ctx: zmq.asyncio.Context | None = None) -> None:
        config.validate()
        self.config = config
        self._own_ctx = ctx is None
        self._ctx = ctx if ctx is not None else zmq.asyncio.Context()
        self._sync_ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.shadow(self._ctx.underlying)
        self._writer = PayloadWriter(config.release, config.dp_rank)
        self._new_replay_framing = version_tuple(config.release) >= (0, 26, 0)
        self._topic = config.topic.encode()
        self._rng = random.Random(config.seed)
        self.drop_rate = config.drop_rate
        self.replay_muted = False
        self.stats = PublisherStats()
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._held: list[tuple[int, bytes]] = []
        self._stalled = False
        self._corrupt = 0
        self._pub: zmq.Socket[bytes] | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._up = False
        self.bind_retry_s = 2.0
        """How long ``start`` retries a port still in use (ZeroMQ frees a closed socket's port
        asynchronously, so a restart right after a crash can find it busy for a moment)."""

    # ------------------------------------------------------------------ lifecycle
    @property
    def running(self) -> bool:
        return self._up

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch gets."""
        return self._seq

    async def start(self) -> None:
        """Open the sockets (bind or connect the PUB, bind the ROUTER) and serve replay."""
        if self._up:
            return
        cfg = self.config
        pub = self._sync_ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, cfg.hwm)
        try:
            if cfg.connect:
                pub.connect(cfg.pub_endpoint)
            else:
                await _bind(pub, cfg.pub_endpoint, self.bind_retry_s)
        except zmq.ZMQError as e:
            pub.close(linger=0)
            raise PublisherError(f"cannot open PUB at {cfg.pub_endpoint}: {e}") from None
        self._pub = pub
        rep = cfg.router_endpoint
        if rep is not None:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            try:
                await _bind(router, rep, self.bind_retry_s)
            except zmq.ZMQError as e:
                router.close(linger=0)
                self._close_sockets()
                raise PublisherError(f"cannot bind replay ROUTER at {rep}: {e}") from None
            self._router = router
            self._task = asyncio.create_task(self._serve_replay(router), name=f"replay:{rep}")
        self._up = True

    async def stop(self) -> None:
        """Close everything (idempotent).  Held batches are discarded."""
        await self._shutdown()
        if self._own_ctx:
            self._ctx.term()
            self._own_ctx = False

    async def __aenter__(self) -> EventPublisher:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _shutdown(self) -> None:
        self._up = False
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._close_sockets()

    def _close_sockets(self) -> None:
        if self._pub is not None:
            self._pub.close(linger=0)
            self._pub = None
        if self._router is not None:
            self._router.close(linger=0)
            self._router = None

    # ------------------------------------------------------------------ publishing
    def publish(self, events: Sequence[KVEvent], *, ts: float | None = None) -> int | None:
        """Publish one engine step's events as one batch.  Returns its sequence number, or None when there
        were no events (vLLM sends nothing for an idle step) or the publisher is down (crashed)."""
        if not events:
            return None
        if not self._up:
            self.stats.refused += 1
            return None
        payload = self._writer.payload(events, time.time() if ts is None else ts)
        seq = self._seq
        self._seq += 1
        self.stats.batches += 1
        if self._corrupt:
            self._corrupt -= 1
            self.stats.corrupted += 1
            payload = b"\xc1" + payload[1:]  # 0xc1 is never valid msgpack
        if self._stalled:
            self._held.append((seq, payload))
        else:
            self._send(seq, payload)
        return seq

    def _send(self, seq: int, payload: bytes) -> None:
        self._buffer.append((seq, payload))
        if self.drop_rate and self._rng.random() < self.drop_rate:
            self.stats.dropped += 1
            return
        assert self._pub is not None
        try:
            self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
            self.stats.sent += 1
        except zmq.Again:
            self.stats.dropped += 1

    # ------------------------------------------------------------------ replay
    async def _serve_replay(self, router: zmq.asyncio.Socket) -> None:
        end = [b"", b"", END_SEQ, b""] if self._new_replay_framing else [b"", END_SEQ, b""]
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                continue  # vLLM ignores (logs) anything but [identity, b"", start_seq8]
            self.stats.replay_requests += 1
            if self.replay_muted:
                continue
            ident, start = frames[0], int.from_bytes(frames[-1], "big")
            for seq, payload in list(self._buffer):
                if seq < start:
                    continue
                seq8 = seq.to_bytes(8, "big")
                body = [b"", self._topic, seq8, payload] if self._new_replay_framing else [b"", seq8, payload]
                await router.send_multipart([ident, *body])
                self.stats.replayed_batches += 1
            await router.send_multipart([ident, *end])

    def buffered_seqs(self) -> list[int]:
        return [s for s, _ in self._buffer]

    # ------------------------------------------------------------------ faults
    def set_drop_rate(self, rate: float) -> None:
        if not 0.0 <= rate <= 1.0:
            raise SimConfigError("drop rate must be in [0, 1]")
        self.drop_rate = rate

    def stall(self) -> None:
        """Hold batches from now on (they keep their sequence numbers)."""
        self._stalled = True

    def resume(self) -> None:
        """Send the held batches in order, then publish normally."""
        self._stalled = False
        held, self._held = self._held, []
        for seq, payload in held:
            if self._up:
                self._send(seq, payload)

    @property
    def stalled(self) -> bool:
        return self._stalled

    @property
    def num_held(self) -> int:
        """Batches held by the stall, not sent yet."""
        return len(self._held)

    def corrupt_next(self, n: int = 1) -> None:
        """The next ``n`` batches go out undecodable (their sequence numbers are still consumed)."""
        self._corrupt += n

    async def crash(self) -> None:
        """The engine process died: sockets close, history is lost, publishing is refused until restart."""
        await self._shutdown()
        self._seq = 0
        self._buffer.clear()
        self._held.clear()
        self._stalled = False
        self._corrupt = 0

    async def restart(self) -> None:
        """Come back after a crash (or crash and come back): sequence from 0, empty replay buffer."""
        if self._up:
            await self.crash()
        await self.start()
