"""The ZeroMQ shell: one SUB per publisher (connect mode) or one bound SUB (bind mode), plus replays.

::

    vLLM PUB ──[topic, seq8, payload]──▶ SUB ──▶ per-source task ──▶ Indexer.on_message ──▶ index
    vLLM ROUTER ◀──[b"", start8]── DEALER      (replay on gap, connect and late join: Indexer.on_replay)

Every decision about sequences lives in the pure ``SourceSync``; this module only moves bytes.  Writes to
the index happen in the event-loop thread, one message at a time, never across an ``await``.  Each
connect-mode source has its own socket with a receive high-water mark, so a flooding publisher fills
only its own queue (a drop shows as a sequence gap, recovered by replay), and the reader yields to the
loop every few messages so it cannot starve the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from .config import FleetConfig, IndexerOptions, InstanceConfig
from .indexer import Indexer
from .types import SourceKey

log = logging.getLogger("kvrouter.indexer.subscriber")

END_SEQ = b"\xff" * 8
_YIELD_EVERY = 32


class SourceStatus(msgspec.Struct):
    """What the shell knows about one publisher's connection."""

    endpoint: str | None
    replay: str | None
    connected: bool = False
    ever_connected: bool = False
    disconnected_at: float | None = None
    messages: int = 0
    last_message_at: float | None = None
    """When a batch last arrived (published, or new by replay)."""
    probes: int = 0
    """Idle probes (``IndexerOptions.idle_probe_s``) sent since the last message."""
    probed_at: float | None = None
    """When the last of them went out."""
    mode: str = "connect"
    """``connect``: our SUB connects to the engine's bound PUB; ``bind``: our SUB is bound at ``endpoint``
    and the engine's PUB connects to it (``InstanceConfig.events_mode``)."""
    error: str | None = None
    """Why the socket is not set up (a bind that failed: the address is not ours, or taken)."""


def replay_reply(frames: list[bytes]) -> tuple[bytes, bytes] | None:
    """(seq, payload) of one replay reply, in either release's framing; None if it is neither.  The end
    marker is a reply whose seq is ``END_SEQ``."""
    if len(frames) == 3:  # vLLM <= 0.25: [b"", seq, payload]
        return frames[1], frames[2]
    if len(frames) == 4:  # vLLM >= 0.26: [b"", topic, seq, payload]
        return frames[2], frames[3]
    return None


class EventSubscriber:
    """Subscribes to a fleet's KV events and feeds the ``Indexer``.  ``start()`` / ``stop()``."""

    def __init__(
        self, indexer: Indexer, fleet: FleetConfig, *, ctx: zmq.asyncio.Context | None = None
    ) -> None:
        self.indexer = indexer
        self.fleet = fleet
        self.opts: IndexerOptions = fleet.indexer
        self.ctx = ctx or zmq.asyncio.Context()
        self._own_ctx = ctx is None
        self.status: dict[SourceKey, SourceStatus] = {}
        self.counters: Counter[str] = Counter()
        self._unlisted: set[str] = set()
        """Bind mode: instance names not in the fleet that created sources (capped)."""
        self._tasks: dict[str, list[asyncio.Task[None]]] = {}
        self._replay_tasks: dict[SourceKey, asyncio.Task[None]] = {}
        self._replays_alive: set[asyncio.Task[None]] = set()
        """Every replay task not finished yet, the cancelled ones included: stop() awaits them all, so no
        DEALER outlives the subscriber (a pending one would also block the context's term)."""
        self._replay_eps: dict[SourceKey, str] = {}
        self._bind_task: asyncio.Task[None] | None = None
        self._bind_sock: zmq.asyncio.Socket | None = None
        self._closing = False

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        for inst in self.fleet.instances:
            self.add_instance(inst)
        if self.fleet.bind:
            self._bind_sock = self._sub_socket()
            self._bind_sock.bind(self.fleet.bind)
            self._bind_task = asyncio.create_task(self._bind_loop(self._bind_sock), name="kv-bind")
        await asyncio.sleep(0)

    async def stop(self) -> None:
        self._closing = True
        tasks = [t for ts in self._tasks.values() for t in ts] + list(self._replays_alive)
        if self._bind_task:
            tasks.append(self._bind_task)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        self._replay_tasks.clear()
        if self._bind_sock is not None:
            self._bind_sock.close(linger=0)
        if self._own_ctx:
            self.ctx.destroy(linger=0)  # closes whatever socket is left instead of waiting on it forever

    def add_instance(self, inst: InstanceConfig) -> None:
        """Subscribe to a (new) instance: one task per data-parallel rank."""
        if inst.name in self._tasks:
            return
        tasks: list[asyncio.Task[None]] = []
        for src in inst.sources():
            ep = inst.events_endpoint(src.dp_rank)
            rep = inst.replay_endpoint(src.dp_rank)
            self.indexer.register(src, has_replay=rep is not None)
            self.status[src] = SourceStatus(ep, rep, mode=inst.events_mode)
            if rep is not None:
                self._replay_eps[src] = rep
            if ep is not None:
                loop = self._source_loop(src, ep, inst.topic, bind=inst.events_mode == "bind")
                tasks.append(asyncio.create_task(loop, name=f"kv-{src.label()}"))
        self._tasks[inst.name] = tasks

    async def remove_instance(self, name: str) -> None:
        """Unsubscribe and forget an instance's blocks (it left the fleet)."""
        for t in self._tasks.pop(name, []):
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._unlisted.discard(name)
        for src in [s for s in self.status if s.instance == name]:
            self.status.pop(src, None)
            self._replay_eps.pop(src, None)
            task = self._replay_tasks.pop(src, None)
            if task:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self.indexer.remove_instance(name)

    # ------------------------------------------------------------------ sockets
    def _sub_socket(self) -> zmq.asyncio.Socket:
        s = self.ctx.socket(zmq.SUB)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVHWM, self.opts.queue_size)
        s.setsockopt(zmq.RECONNECT_IVL, 100)
        s.setsockopt(zmq.RECONNECT_IVL_MAX, int(self.opts.reconnect_max_s * 1000))
        return s

    async def _bound_sub(self, src: SourceKey, endpoint: str, status: SourceStatus) -> zmq.asyncio.Socket:
        """A SUB bound at ``endpoint`` for one engine that connects out to it; retried while the address
        cannot be bound (taken by a process not yet gone, or not this host's), the reason in ``status``."""
        delay = 0.2
        while True:
            sub = self._sub_socket()
            try:
                sub.bind(endpoint)
            except zmq.ZMQError as e:
                sub.close(linger=0)
                if status.error is None:
                    log.error(
                        "kv events: cannot bind where the engine connects",
                        extra={"source": src.label(), "endpoint": endpoint, "error": str(e)},
                    )
                status.error = f"bind {endpoint}: {e}"
                self.counters["bind_errors"] += 1
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.opts.reconnect_max_s)
                continue
            status.error = None
            return sub

    async def _source_loop(self, src: SourceKey, endpoint: str, topic: str, *, bind: bool = False) -> None:
        status = self.status[src]
        sub = await self._bound_sub(src, endpoint, status) if bind else self._sub_socket()
        sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        # A bound SUB sees the engine's PUB arrive as an accepted connection, a connecting one as connected.
        mon = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        if not bind:
            sub.connect(endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(mon, zmq.POLLIN)
        timeout = self._poll_timeout_ms()
        try:
            while True:
                events = dict(await poller.poll(timeout=timeout))
                if mon in events:
                    self._on_monitor(src, status, parse_monitor_message(await mon.recv_multipart()))
                if sub in events:
                    for _ in range(_YIELD_EVERY):
                        self._on_frames(src, status, await sub.recv_multipart())
                        if not int(sub.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                            break
                self._check_stale(src, status)
                self._check_idle(src, status)
                await asyncio.sleep(0)
        finally:
            sub.disable_monitor()
            mon.close(linger=0)
            sub.close(linger=0)

    def _on_monitor(self, src: SourceKey, status: SourceStatus, msg: Mapping[str, Any]) -> None:
        ev = msg.get("event")
        if ev in (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED):
            status.connected = True
            status.ever_connected = True
            status.disconnected_at = None
            self.counters["connects"] += 1
            log.info("kv events connected", extra={"source": src.label(), "endpoint": status.endpoint})
            self._request_replays(src, self.indexer.on_connect(src))
        elif ev == zmq.EVENT_DISCONNECTED:
            status.connected = False
            status.disconnected_at = time.monotonic()
            self.counters["disconnects"] += 1
            log.warning("kv events disconnected", extra={"source": src.label(), "endpoint": status.endpoint})

    def _check_stale(self, src: SourceKey, status: SourceStatus) -> None:
        since = status.disconnected_at
        if since is not None and time.monotonic() - since > self.opts.stale_after_s:
            log.warning("source silent too long; dropping its blocks", extra={"source": src.label()})
            self.indexer.forget_source(src)
            status.disconnected_at = None
            self.counters["stale_drops"] += 1

    def _poll_timeout_ms(self) -> int:
        """Wake often enough to notice a source going idle (at most every second)."""
        probe = self.opts.idle_probe_s
        return 1000 if probe <= 0 else max(10, int(min(1.0, probe / 2) * 1000))

    def _check_idle(self, src: SourceKey, status: SourceStatus) -> None:
        """Probe a quiet source: a replay from ``last`` brings any batch that was lost at the tail.  The
        first probe goes ``idle_probe_s`` after the last message, each later one twice the previous
        interval after it (at most ``idle_probe_max_s``): a batch lost after a probe, with nothing
        following it, is found by the next one rather than never."""
        probe = self.opts.idle_probe_s
        if (
            probe <= 0
            or not status.connected
            or status.last_message_at is None
            or src not in self._replay_eps
            or src in self._replay_tasks
        ):
            return
        now = time.monotonic()
        if status.probed_at is None:
            due = status.last_message_at + probe
        else:
            step = probe * 2.0 ** min(status.probes, 40)  # the exponent bounded: a float, never overflowing
            due = status.probed_at + min(step, self.opts.idle_probe_max_s)
        if now < due:
            return
        status.probes += 1
        status.probed_at = now
        starts = self.indexer.on_idle(src)
        if starts:
            self.counters["idle_probes"] += 1
        self._request_replays(src, starts)

    def _on_frames(self, src: SourceKey | None, status: SourceStatus | None, frames: list[bytes]) -> None:
        """One message.  Nothing it holds may stop the loop that read it (in bind mode, every source's)."""
        try:
            self._handle_frames(src, status, frames)
        except Exception:  # a bug, not bad input (that is counted by reason): count, log, keep reading
            self.counters["internal_errors"] += 1
            log.exception("kv event message not handled", extra={"source": src.label() if src else None})

    def _handle_frames(self, src: SourceKey | None, status: SourceStatus | None, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.counters["bad_frames"] += 1
            return
        topic, seq_b, payload = frames
        if src is None:
            src = self._bind_source(topic, payload)
            if src is None:
                return
            status = self.status.get(src)
        if status is not None:
            status.messages += 1
            status.last_message_at = time.monotonic()
            status.probes, status.probed_at = 0, None
        seq = int.from_bytes(seq_b, "big")
        self._request_replays(src, self.indexer.on_message(src, seq, payload))

    # ------------------------------------------------------------------ bind mode
    def _bind_source(self, topic: bytes, payload: bytes) -> SourceKey | None:
        """``kv@<instance>@<model>`` names the instance; the batch names its rank."""
        parts = topic.decode("utf-8", "replace").split("@")
        if len(parts) < 2 or parts[0] != "kv" or not parts[1]:
            self.counters["bad_topic"] += 1
            return None
        name = parts[1]
        inst = self.fleet.instance(name)
        src = self.indexer.source_of(name, payload)
        if src not in self.status and inst is None:
            if self.opts.bind_accept == "listed":
                self._refuse_bind(name, "bind_unlisted")
                return None
            if len(self._unlisted) >= self.opts.max_bind_sources and name not in self._unlisted:
                self._refuse_bind(name, "bind_too_many_sources")
                return None
            self._unlisted.add(name)
        if src not in self.status:
            rep = inst.replay_endpoint(src.dp_rank) if inst else None
            self.indexer.register(src, has_replay=rep is not None)
            self.status[src] = SourceStatus(self.fleet.bind, rep, connected=True, ever_connected=True)
            if rep is not None:
                self._replay_eps[src] = rep
        return src

    def _refuse_bind(self, name: str, reason: str) -> None:
        self.counters[reason] += 1
        if self.counters[reason] == 1:  # once: a stray publisher sends a batch per engine step
            log.warning("kv events refused in bind mode", extra={"instance": name[:200], "reason": reason})

    async def _bind_loop(self, sub: zmq.asyncio.Socket) -> None:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        timeout = self._poll_timeout_ms()
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        while True:
            if await poller.poll(timeout=timeout):
                for _ in range(_YIELD_EVERY):
                    self._on_frames(None, None, await sub.recv_multipart())
                    if not int(sub.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                        break
            for src, status in list(self.status.items()):
                if status.endpoint == self.fleet.bind:
                    self._check_idle(src, status)
                    self._check_bind_stale(src, status)
            await asyncio.sleep(0)

    def _check_bind_stale(self, src: SourceKey, status: SourceStatus) -> None:
        """An unlisted bind-mode source silent for ``stale_after_s`` is forgotten and frees its place under
        ``max_bind_sources`` (bind mode sees no disconnects: silence is the only sign a pod went away)."""
        last = status.last_message_at
        if src.instance not in self._unlisted or last is None:
            return
        if time.monotonic() - last <= self.opts.stale_after_s:
            return
        log.warning("bind-mode source silent too long; forgetting it", extra={"source": src.label()})
        self.status.pop(src, None)
        self._replay_eps.pop(src, None)
        if any(s.instance == src.instance for s in self.status):
            self.indexer.forget_source(src)  # another rank of the instance still publishes
        else:
            self.indexer.remove_instance(src.instance)  # its index slots are freed too
            self._unlisted.discard(src.instance)
        self.counters["stale_drops"] += 1

    # ------------------------------------------------------------------ replay
    def _request_replays(self, src: SourceKey, starts: list[int]) -> None:
        for start in starts:
            ep = self._replay_eps.get(src)
            if ep is None or self._closing:
                self._request_replays(src, self.indexer.on_replay_end(src, complete=False))
                continue
            old = self._replay_tasks.pop(src, None)
            if old is not None:
                old.cancel()
            self.counters["replay_requests"] += 1
            task = asyncio.create_task(self._replay(src, ep, start), name=f"replay-{src.label()}")
            self._replays_alive.add(task)
            task.add_done_callback(self._replays_alive.discard)
            self._replay_tasks[src] = task

    async def _replay(self, src: SourceKey, endpoint: str, start: int) -> None:
        """Ask the engine's ROUTER for every buffered batch from ``start``; a fresh DEALER per request, so a
        late answer to an old request can never be mistaken for this one."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        before = self.indexer.sync(src).last
        got = 0
        ended = False
        try:
            async with asyncio.timeout(self.opts.replay_timeout_s):
                await dealer.send_multipart([b"", start.to_bytes(8, "big")])
                while True:
                    frames = await dealer.recv_multipart()
                    reply = replay_reply(frames)
                    if reply is None:
                        self.counters["bad_replay_frames"] += 1
                        continue
                    seq_b, payload = reply
                    if seq_b == END_SEQ:
                        ended = True
                        break
                    if len(seq_b) != 8:
                        self.counters["bad_replay_frames"] += 1
                        continue
                    got += 1
                    again = self.indexer.on_replay(src, int.from_bytes(seq_b, "big"), payload)
                    if again:  # the engine restarted while we were away: replay the new process instead
                        self._request_replays(src, again)
                        return
                    if got % _YIELD_EVERY == 0:
                        await asyncio.sleep(0)
        except TimeoutError:
            self.counters["replay_timeouts"] += 1
            log.warning("replay timed out", extra={"source": src.label(), "start": start, "received": got})
        except (zmq.ZMQError, ValueError, TypeError, RuntimeError):
            # Never leave the source syncing forever: whatever stopped the replay, end it below.
            self.counters["internal_errors"] += 1
            log.exception("replay failed", extra={"source": src.label(), "start": start})
        finally:
            dealer.close(linger=0)
            if self._replay_tasks.get(src) is asyncio.current_task():
                del self._replay_tasks[src]
        self.counters["replayed_batches"] += got
        self._request_replays(src, self.indexer.on_replay_end(src, complete=ended))
        status = self.status.get(src)
        if status is not None and self.indexer.sync(src).last != before:
            # New batches came by replay (a late join's, or the lost ones a probe found): the source was
            # heard from now, and a quiet spell (the probes' clock) starts here.  Without this, a source
            # whose batches all came by replay was never probed.
            status.last_message_at = time.monotonic()
            status.probes, status.probed_at = 0, None
