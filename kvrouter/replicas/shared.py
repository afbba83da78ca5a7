"""``SharedState``: the asyncio shell that keeps one router replica in agreement with its peers.

::

    every interval_s:  ReplicaState.request ──▶ ReplicaStore.sync (one round trip) ──▶ ReplicaState.apply
                       on error: count by reason, log once per outage, keep routing on the local view;
                       past lease_s without success, drop the peers' load; read the whole window again
                       on the first success after an outage (resynchronised)
    ``fresh``: before placing a prompt no target holds, a round trip begun after the call; ``nudge``:
                       after it, the next round trip at once (``replicas.claim_new_prefixes``)

Lifecycle: ``await start()`` once the router exists (it turns on ``Indexer.speculative_outbox``),
``await stop()`` on shutdown (cancels the task, drops this replica's lease in the store at once, bounded
by ``timeout_s``).  Only ``fresh`` runs on the request path, for a prompt no target holds (why:
docs/replicas.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import redis
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from ..loop_lag import LoopLag
from ..routing import Router
from ..routing.response_affinity import ResponseAffinity
from .config import SharedStateConfig
from .flows import ReplicaFlows
from .metrics import SharedStateMetrics
from .state import ReplicaState
from .store import RedisReplicaStore, ReplicaStore

log = logging.getLogger("kvrouter.replicas")


def error_reason(e: BaseException) -> str:
    """The metric label of a failed round trip."""
    if isinstance(e, redis.TimeoutError | TimeoutError):
        return "timeout"
    if isinstance(e, redis.ConnectionError | OSError):
        return "connection"
    if isinstance(e, redis.ResponseError):
        return "response"
    if isinstance(e, redis.RedisError):
        return "redis"
    return "internal"


class SharedState:
    """Shares this replica's in-flight load and speculative entries through a store, and takes the peers'."""

    def __init__(
        self,
        router: Router,
        config: SharedStateConfig,
        *,
        registry: CollectorRegistry | None = None,
        store: ReplicaStore | None = None,
        clock: Callable[[], float] = time.monotonic,
        affinity: ResponseAffinity | None = None,
        lag: LoopLag | None = None,
        flows: ReplicaFlows | None = None,
    ) -> None:
        """``affinity``: the response ids to share (which instance holds each stored response); ``lag``:
        this process's event-loop delay (a round trip that timed out while the loop stood still is
        retried, not counted as an outage); ``flows``: the queue, flow accounts and rate limits to share."""
        self.lag = lag
        config.validate()
        self.config = config
        self.router = router
        self.clock = clock
        self._client: aioredis.Redis | None = None
        if store is None:
            if config.redis_url is None:
                raise ValueError("SharedState needs a store or config.redis_url")
            self._client = aioredis.Redis.from_url(
                config.redis_url,
                decode_responses=False,
                socket_timeout=config.timeout_s,
                socket_connect_timeout=config.timeout_s,
                retry=Retry(NoBackoff(), 0),  # the loop retries every interval_s
            )
            store = RedisReplicaStore(self._client, config.namespace)
        self.store = store
        self.replica = config.resolved_replica_id()
        self.state = ReplicaState(
            router,
            self.replica,
            speculative=config.speculative,
            max_unsent=config.max_unsent,
            affinity=affinity,
            flows=flows,
        )
        self.metrics = SharedStateMetrics(registry)
        self._task: asyncio.Task[None] | None = None
        self._last_ok: float | None = None
        self._down_since: float | None = None
        self._started = 0.0
        self._reported = (0, 0)  # (applied, dropped) already added to the counters
        self._kick = asyncio.Event()
        """Set: the loop starts its next round trip now rather than at the end of the interval."""
        self._begun = 0
        """Round trips begun; ``_ended``: the latest of them that ended (ok or not)."""
        self._ended = 0
        self._progress = asyncio.Event()
        """Set (and replaced) whenever a round trip ends: ``fresh`` waits on it."""
        self.fresh_waits = 0
        """Decisions that waited for a round trip (``fresh``), and of those the ones that gave up."""
        self.fresh_timeouts = 0

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self._task is not None:
            return
        if self.config.speculative and self.router.indexer.speculative_outbox is None:
            self.router.indexer.speculative_outbox = []
        if self.state.affinity is not None and self.state.affinity.outbox is None:
            self.state.affinity.outbox = []
        self._started = self.clock()
        await self.sync_once()
        self._task = asyncio.create_task(self._run(), name="kvrouter-shared-state")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.router.indexer.speculative_outbox = None
        if self.state.affinity is not None:
            self.state.affinity.outbox = None
        with contextlib.suppress(redis.RedisError, OSError, TimeoutError):
            async with asyncio.timeout(self.config.timeout_s):
                await self.store.leave(self.replica)
        self.state.forget_peers()
        if self._client is not None:
            await self._client.aclose()

    async def _run(self) -> None:
        interval = self.config.interval_s
        while True:
            t0 = self.clock()
            self._kick.clear()
            await self.sync_once()
            left = interval - (self.clock() - t0)
            if left > 0 and not self._kick.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(left):
                        await self._kick.wait()

    def nudge(self) -> None:
        """Start the next round trip now (this replica just placed a new prompt: publish it)."""
        if self._task is not None:
            self._kick.set()

    async def fresh(self) -> None:
        """Return once a round trip begun after this call has ended, or after ``timeout_s`` (then the
        decision uses what is known).  Concurrent callers share that round trip; while the store does not
        answer (or in a worker that makes no round trips) it returns at once."""
        if self._task is None or self._down_since is not None or self._last_ok is None:
            return
        want = self._begun + 1
        self.fresh_waits += 1
        self._kick.set()
        try:
            async with asyncio.timeout(self.config.timeout_s):
                while self._ended < want:
                    await self._progress.wait()
        except TimeoutError:
            self.fresh_timeouts += 1

    # ------------------------------------------------------------------ one round trip
    async def sync_once(self) -> bool:
        """Publish and read once.  Never raises: failures are counted and the local view stays in use."""
        self._begun += 1
        n = self._begun
        try:
            return await self._sync()
        finally:
            self._ended = max(self._ended, n)
            done, self._progress = self._progress, asyncio.Event()
            done.set()

    async def _sync(self) -> bool:
        c = self.config
        now = self.clock()
        req = self.state.request(now, lease_s=c.lease_s, window_s=c.speculative_window_s, max_read=c.max_read)
        t0 = time.perf_counter()
        mark = self.lag.mark() if self.lag is not None else 0.0
        try:
            async with asyncio.timeout(2 * c.timeout_s):
                reply = await self.store.sync(req)
        except Exception as e:  # Redis or network errors; a bug must not stop the loop either ("internal")
            if error_reason(e) == "timeout" and self.lag is not None and self.lag.stalled(mark, c.timeout_s):
                # This process stood still, not Redis: the next round trip decides (its entries are kept).
                self.metrics.errors.labels("stalled").inc()
                return False
            self._failed(now, e)
            return False
        self.metrics.sync_seconds.observe(time.perf_counter() - t0)
        self.state.published()
        self.state.apply(reply, self.clock())
        if self._down_since is not None:
            log.info(
                "shared state store reachable again; resynchronised",
                extra={"replica": self.replica, "outage_s": round(now - self._down_since, 3)},
            )
            self._down_since = None
        self._last_ok = now
        self.metrics.up.set(1)
        self.metrics.peers.set(self.state.peers)
        self._export_counts()
        return True

    def _failed(self, now: float, e: BaseException) -> None:
        reason = error_reason(e)
        self.metrics.errors.labels(reason).inc()
        self.metrics.up.set(0)
        if self._down_since is None:
            self._down_since = now
            # once per outage: the loop retries every interval_s and would flood the log otherwise
            log.warning(
                "shared state store unreachable; routing on this replica's own view until it returns",
                extra={"replica": self.replica, "reason": reason, "error": repr(e)},
                exc_info=reason == "internal",
            )
        self.state.resync()
        if now - (self._last_ok if self._last_ok is not None else self._started) >= self.config.lease_s:
            self.state.forget_peers()  # their leases have ended by now anyway
            self.metrics.peers.set(0)
        self.state.take_outbox(now)
        self._export_counts()

    def _export_counts(self) -> None:
        applied, dropped = self.state.applied_entries, self.state.dropped_entries
        self.metrics.peer_speculative.inc(applied - self._reported[0])
        self.metrics.dropped_speculative.inc(dropped - self._reported[1])
        self._reported = (applied, dropped)

    # ------------------------------------------------------------------ observability
    def status(self) -> dict[str, Any]:
        """For /health: whether the store answers, since when it does not, and how many peers are live."""
        now = self.clock()
        return {
            "replica": self.replica,
            "up": self._down_since is None and self._last_ok is not None,
            "peers": self.state.peers,
            "down_for_s": None if self._down_since is None else round(now - self._down_since, 3),
            "unsent_speculative": len(self.state.unsent),
            "peer_speculative_applied": self.state.applied_entries,
            "done_before_published": self.state.done_unsent,
            "fresh_waits": self.fresh_waits,
            "fresh_timeouts": self.fresh_timeouts,
            "peers_waiting": None if self.state.flows is None else self.state.flows.board.peers_waiting(),
        }
