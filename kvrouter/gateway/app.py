"""The gateway: one process's components, wired once and started and stopped together::

    Gateway
    ├── Indexer ◀── EventSubscriber (ZeroMQ; none with a remote indexer)   WarmRestart (snapshots)
    ├── Router (routing/) ── LoadTracker                                   SharedState (replicas, Redis)
    ├── UpstreamPool (health, ejection, engine load)  ◀── MembershipRuntime (fleet file, Kubernetes)
    ├── RequestPipeline (pipeline/): parse → tokenize → hash → look up → decide → account
    │     └── ResponseAffinity: which instance holds each stored response (shared through SharedState)
    ├── AdapterManager: LoRA loads and unloads passed on, adapters loaded on demand
    ├── Proxy: the bytes, upstream and back (after ``start``: it needs the client session)
    ├── LoopLag: how far the event loop is behind (admission; timeouts judged against it)
    └── DisaggProxy: a disaggregated model's two legs, over the Proxy

HTTP routes: ``handlers``; ``build_gateway`` makes the aiohttp app.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from typing import Protocol

import aiohttp
import msgspec
from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.exposition import choose_encoder

from indexer import Indexer, LookupResult
from indexer.config import InstanceConfig
from indexer.hashing import TokenIds, id_list
from indexer.metrics import IndexerCollector
from indexer.subscriber import EventSubscriber

from ..api.requests import ParsedRequest
from ..config import RouterFleetConfig
from ..flows import ProcessBoard
from ..host import HealthBoard, HostLoads, QueueBoard
from ..host.metric_merge import Merged
from ..loop_lag import LoopLag
from ..pipeline import PassThroughTokens, RequestPipeline, TokenSource
from ..pipeline.metrics import FlowAccountsCollector
from ..pipeline.pipeline import PlacementClaims
from ..replicas import PrefixClaims, ReplicaFlows, SharedState, WarmRestart, mark_restored, store_for
from ..routing import LoadTracker, Router
from ..routing.peer_prefill import PeerPrefill
from ..routing.policies import ModelStore
from ..routing.router import HostSync
from ..telemetry import Telemetry
from ..telemetry.metrics import TelemetryCollector
from .adapters import AdapterManager
from .disagg_proxy import DisaggProxy
from .event_sources import EventSourceResolver
from .fleet_check import check_fleet
from .membership_metrics import MembershipCollector
from .membership_runtime import MembershipRuntime
from .metrics import GatewayMetrics
from .parity_probe import ParityProber
from .proxy import Proxy
from .upstream import UpstreamPool
from .upstream_http import UpstreamHttp


class HostScrape(Protocol):
    """The host's /metrics over every worker (``kvrouter.host.scrape.HostScrape``)."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    async def families(self) -> list[Metric]: ...


class WorkerShare(Protocol):
    """One worker's share of its host's state under ``serve --workers N``
    (``kvrouter.host.wiring.WorkerHost``): what the gateway's parts are built over instead of their own
    in-process state."""

    me: int
    loads: HostLoads
    health: HealthBoard
    queue: QueueBoard

    @property
    def latency(self) -> ModelStore:
        """The targets' latency models, learned by every worker together (``kvrouter.host.latency``)."""

    @property
    def leader(self) -> bool: ...

    @property
    def workers(self) -> int: ...

    def placement_claims(self, ttl_s: float, registry: CollectorRegistry | None = None) -> PlacementClaims:
        """Claims of new prompts' targets between the host's workers (``kvrouter.host.claims``)."""

    def ring_sync(
        self, indexer: Indexer, *, keep_outbox: bool, peer_prefill: PeerPrefill | None = None
    ) -> HostSync:
        """The router's exchange of speculative entries with the other workers."""

    def scrape(
        self, collect: Callable[[], Iterable[Metric]], refresh: Callable[[], None]
    ) -> HostScrape | None:
        """The host's /metrics over every worker (None: this worker's registry alone)."""

    def state(self) -> dict[str, object]:
        """This worker's place on its host, for /health."""


log = logging.getLogger("kvrouter.gateway")


class Gateway:
    """Everything one gateway process holds; lives as long as the app."""

    def __init__(
        self,
        cfg: RouterFleetConfig,
        *,
        tokens: TokenSource | None = None,
        policy: str | None = None,
        subscribe: bool = True,
        fleet_path: str | None = None,
        host: WorkerShare | None = None,
    ) -> None:
        """``host``: this worker's share of the host's state (several workers on one host; None: one
        process).  Every part that counts load, health, the queue or speculative entries is built over it."""
        self.cfg = cfg
        # With a remote indexer, events are indexed there; this router keeps only its speculative entries.
        remote_index = cfg.gateway.indexer_url is not None
        self.indexer = Indexer.for_fleet(cfg, reserve=not remote_index)
        self.subscriber = EventSubscriber(self.indexer, cfg) if subscribe and not remote_index else None
        rep = cfg.replicas
        # Other replicas' queued prefill, when replicas share speculative entries (``replicas.state``).
        peer_prefill = PeerPrefill(cfg.block_size) if rep.redis_url and rep.speculative else None
        self.router = Router(
            self.indexer,
            cfg.router_config(policy),
            load=LoadTracker(host.loads if host is not None else None),
            # The leader keeps the whole host's entries for the replicas to publish, when they share.
            host=host.ring_sync(
                self.indexer, keep_outbox=host.leader and bool(rep.redis_url), peer_prefill=peer_prefill
            )
            if host is not None
            else None,
            peer_prefill=peer_prefill,
            latency_store=host.latency if host is not None else None,
        )
        self.metrics = GatewayMetrics()
        self.metrics.registry.register(IndexerCollector(self.indexer, self.subscriber))
        self.lag = LoopLag()
        """This process's event-loop delay: admission reads it, and timeouts are judged against it."""
        g = cfg.gateway
        self.pool = UpstreamPool(
            cfg.instances,
            self.router.load,
            health_interval_s=g.health_interval_s,
            metrics_interval_s=g.metrics_interval_s,
            failure_threshold=g.failure_threshold,
            health_timeouts=g.health_timeouts,
            ejection_s=g.ejection_s,
            ejection_max_s=g.ejection_max_s,
            on_change=self._health_transition,
            on_eject=lambda name, _span: self.metrics.ejections.labels(name).inc(),
            board=host.health if host is not None else None,
            scrape_engines=host is None or host.leader,
            lag=self.lag,
        )
        self.tokens = tokens or PassThroughTokens()
        self.telemetry = Telemetry(cfg.tracing, cfg.access_log)
        self.metrics.registry.register(TelemetryCollector(self.telemetry))
        # The limits' queue is the host's (workers) and, with replicas, every replica's: one board for both.
        board: QueueBoard | ProcessBoard | None = (
            host.queue if host is not None else ProcessBoard(cfg.flows.max_flows) if rep.redis_url else None
        )
        self.pipeline = RequestPipeline(
            cfg,
            self.router,
            self.pool,
            self.tokens,
            self.metrics.pipeline,
            remote=self.remote_lookup if remote_index else None,
            find_response=self.find_response,
            lag=self.lag,
            telemetry=self.telemetry,
            host_queue=board,
            held_host=host.queue if host is not None else None,
            id_prefix=f"w{host.me}-r" if host is not None else "r",
        )
        self.metrics.registry.register(FlowAccountsCollector(self.pipeline.gate.queue.accounts))
        self.adapters = AdapterManager(self.pool, self.pipeline, cfg.lora)
        self.shared = (
            SharedState(
                self.router,
                rep,
                registry=self.metrics.registry,
                affinity=self.pipeline.affinity,
                lag=self.lag,
                flows=ReplicaFlows(board, self.pipeline.rate, on_peers=self.pipeline.gate.wake)
                if board is not None
                else None,
            )
            if rep.redis_url
            else None
        )
        self.claims = (
            PrefixClaims(rep, self.indexer.speculative_ttl, registry=self.metrics.registry)
            if self.shared is not None and rep.speculative and rep.claim_new_prefixes
            else None
        )
        if self.shared is not None and self.claims is not None:
            self.pipeline.claims = self.claims
            self.pipeline.publish_now = self.shared.nudge
            self.pipeline.peers_fresh = self.shared.fresh
        elif host is not None and host.workers > 1 and self.router.config.speculative:
            # No claims through Redis: the host's workers claim among themselves (a burst of one new
            # prompt spread over the workers goes to one target).
            self.pipeline.claims = host.placement_claims(
                self.indexer.speculative_ttl, registry=self.metrics.registry
            )
        store = store_for(cfg.snapshot, rep.redis_url)
        self.warm = (
            WarmRestart(
                self.indexer, store, interval_s=cfg.snapshot.interval_s, registry=self.metrics.registry
            )
            if store is not None and self.subscriber is not None
            else None
        )
        self.membership = MembershipRuntime(
            self.pool,
            self.indexer,
            self.subscriber,
            cfg,
            fleet_path=fleet_path,
            options=cfg.membership,
            discovery=cfg.discovery,
            on_added=self._instance_added,
            on_removed=self._instance_removed,
        )
        self.metrics.registry.register(MembershipCollector(self.membership))
        self.parity = ParityProber(self.pipeline, self.pool)
        # Events are found on the instances that give only a URL (not in bind mode: they connect to us).
        self.event_sources = EventSourceResolver(
            self.membership.membership, enabled=self.subscriber is not None and cfg.bind is None
        )
        self.session: aiohttp.ClientSession | None = None
        self.http = UpstreamHttp()
        """The proxy's client for http:// upstreams; health checks and scrapes use ``session``."""
        self.proxy: Proxy | None = None
        self.disagg: DisaggProxy | None = None
        self._checks: asyncio.Task[None] | None = None
        self._watch: asyncio.Task[None] | None = None
        self.leader = host is None or host.leader
        """False in a worker of several on one host (``kvrouter.host``): the leader alone writes index
        snapshots, syncs with other hosts' replicas and runs the start-up fleet check."""
        self.host_state: Callable[[], dict[str, object]] | None = host.state if host is not None else None
        """This worker's place on its host, for /health (None: one process)."""
        self.host_scrape: HostScrape | None = (
            host.scrape(self.metrics.registry.collect, self.refresh_gauges) if host is not None else None
        )
        """The host's /metrics over every worker (None: one process, its own registry)."""
        if host is not None:
            self.metrics.worker.labels(str(host.me)).set(1)

    def refresh_gauges(self) -> None:
        """Gauges read at scrape time: in flight per target (the host's, with workers), the queue, the event
        loop (tasks, delay)."""
        load = self.router.load
        load.refresh()
        for key, tl in load.loads.items():
            self.metrics.in_flight.labels(key).set(tl.effective_in_flight())
        self.metrics.pipeline.queue_depth.set(self.pipeline.gate.waiting)
        with contextlib.suppress(RuntimeError):  # no running loop (a snapshot taken off the loop)
            self.metrics.loop_tasks.set(len(asyncio.all_tasks()))
        self.metrics.loop_lag.set(self.lag.standing_s)
        self.metrics.loop_demand.set(self.lag.demand)
        self.metrics.loop_stall_max.set(self.lag.max_s)

    async def exposition(self, accept: str | None) -> tuple[bytes, str]:
        """``/metrics``: this process's registry, or with workers the host's merged families; OpenMetrics
        (with exemplars) when the scraper asks for it."""
        encoder, content_type = choose_encoder(accept or "")
        if self.host_scrape is None:
            self.refresh_gauges()
            return encoder(self.metrics.registry), content_type
        return encoder(Merged(await self.host_scrape.families())), content_type

    def replicas_state(self) -> dict[str, object] | None:
        """For /health: this process's part in sharing state with other router replicas (None: it shares
        nothing).  The leader of several workers makes the round trips; another worker reads the other
        replicas' load from the host's memory and their entries from the leader's ring."""
        if self.shared is None:
            return None
        if self.leader:
            return {"round_trips": True, **self.shared.status()}
        self.router.load.refresh()
        loads = self.router.load.loads.values()
        return {
            "round_trips": False,
            "peers_in_flight": sum(load.external_in_flight for load in loads),
            "peers_prefill_tokens": sum(load.external_prefill_tokens for load in loads),
            "peers_waiting": None
            if self.pipeline.gate.shared is None
            else self.pipeline.gate.shared.peers_waiting(),
        }

    def _health_changed(self, name: str, healthy: bool) -> None:
        for t in self.pool.upstreams[name].targets():
            self.metrics.healthy.labels(t.key).set(1 if healthy else 0)
        if healthy:
            self.pipeline.released()

    def _health_transition(self, name: str, healthy: bool) -> None:
        self._health_changed(name, healthy)
        if healthy:  # back, perhaps restarted: another template, other publishers
            self.parity.instance_back(name)
            asked = self.membership.membership.discoverable(name)
            if asked is not None:
                self.event_sources.watch(asked)

    def _instance_added(self, inst: InstanceConfig) -> None:
        self.event_sources.watch(inst)
        u = self.pool.upstreams.get(inst.name)
        if u is not None:
            self._health_changed(inst.name, u.healthy)

    def _instance_removed(self, inst: InstanceConfig) -> None:
        self.event_sources.forget(inst.name)
        keys = [inst.name] if inst.dp_size == 1 else [f"{inst.name}/{r}" for r in range(inst.dp_size)]
        for key in keys:
            for gauge in (self.metrics.healthy, self.metrics.in_flight):
                with contextlib.suppress(KeyError):
                    gauge.remove(key)

    async def remote_lookup(self, req: ParsedRequest, tokens: TokenIds) -> LookupResult | None:
        """With ``gateway.indexer_url``: the remote indexer's answer (None if it cannot be had: the router
        then routes this request on load alone, and says so in its metrics)."""
        url = self.cfg.gateway.indexer_url
        if not url or self.session is None:
            return None
        body = {"token_ids": id_list(tokens), "cache_salt": req.cache_salt, "lora_name": req.lora_name}
        try:
            async with self.session.post(
                f"{url.rstrip('/')}/v1/cache/lookup", json=body, timeout=aiohttp.ClientTimeout(total=0.5)
            ) as r:
                if r.status != 200:
                    raise ValueError(f"status {r.status}")
                return msgspec.json.decode(await r.read(), type=LookupResult)
        except (aiohttp.ClientError, TimeoutError, ValueError, msgspec.DecodeError) as e:
            self.metrics.pipeline.rejections.labels("remote_index_unavailable").inc()
            log.warning("remote indexer lookup failed", extra={"error": str(e)})
            return None

    async def find_response(self, response_id: str) -> str | None:
        """The instance holding a response id this router was not told about: every healthy instance is
        asked (``GET /v1/responses/{id}``, as vLLM answers it: 200 where it is stored, 404 elsewhere)."""
        if self.session is None:
            return None
        timeout = aiohttp.ClientTimeout(total=self.cfg.responses.probe_timeout_s)
        headers = (
            {"Authorization": f"Bearer {self.cfg.gateway.upstream_api_key}"}
            if self.cfg.gateway.upstream_api_key
            else {}
        )

        async def ask(name: str) -> str | None:
            assert self.session is not None
            try:
                async with self.session.get(
                    f"{self.pool.url(name)}/v1/responses/{response_id}", timeout=timeout, headers=headers
                ) as r:
                    return name if r.status == 200 else None
            except (aiohttp.ClientError, TimeoutError):
                return None

        names = [u.name for u in self.pool.upstreams.values() if u.healthy]
        found = [n for n in await asyncio.gather(*(ask(n) for n in names)) if n is not None]
        self.metrics.pipeline.rejections.labels("response_probe").inc()
        return found[0] if found else None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self.lag.start()
        conn = aiohttp.TCPConnector(limit=0, ttl_dns_cache=10, enable_cleanup_closed=True)
        self.session = aiohttp.ClientSession(connector=conn, auto_decompress=False)
        g = self.cfg.gateway
        self.proxy = Proxy(
            self.session,
            self.pool,
            self.pipeline,
            self.metrics,
            first_byte_timeout_s=g.first_byte_timeout_s,
            chunk_timeout_s=g.chunk_timeout_s,
            connect_timeout_s=g.connect_timeout_s,
            max_retries=g.max_retries,
            upstream_api_key=g.upstream_api_key,
            http=self.http if g.lean_client else None,
            lag=self.lag,
        )
        self.disagg = DisaggProxy(self.proxy)
        self.adapters.session = self.session
        self.adapters.api_key = g.upstream_api_key
        restored = []
        if self.warm is not None:
            only = None if self.cfg.bind else [s for i in self.cfg.instances for s in i.sources()]
            restored = await self.warm.restore(only=only)
        if self.subscriber:
            await self.subscriber.start()
            if restored:
                mark_restored(self.subscriber, restored, time.monotonic())
        if self.warm is not None and self.leader:
            await self.warm.start()
        if self.shared is not None and self.leader:
            await self.shared.start()
        await self.tokens.warm(self.cfg.served_models())
        await self.pool.start(self.session)
        for u in self.pool.upstreams.values():
            self._health_changed(u.name, u.healthy)
        await self.membership.start(self.session)
        await self.event_sources.start(self.session, [u.cfg for u in self.pool.upstreams.values()])
        await self.parity.start(self.session)
        if self.leader:
            self._checks = asyncio.create_task(self._startup_checks(), name="fleet-check")
        if self.subscriber is not None:
            self._watch = asyncio.create_task(self._watch_events(), name="event-watch")
        if self.host_scrape is not None:
            self.host_scrape.start()

    async def _watch_events(self, interval_s: float = 1.0) -> None:
        """Every second: is a source deaf (its instance computes prompts, its live stream brings nothing)?
        Said loudly: an error log line when it starts, ``kvrouter_event_source_deaf``, ``/health``."""
        assert self.subscriber is not None
        watch, sub = self.pipeline.event_watch, self.subscriber
        while True:
            await asyncio.sleep(interval_s)
            live = {src: st.messages for src, st in sub.status.items() if st.endpoint is not None}
            newly, heard = watch.check(live, time.monotonic())
            for src in newly:
                st = sub.status.get(src)
                d = watch.deaf[src]
                log.error(
                    "kv events: source deaf while its instance computes prompts; routing on it approximate",
                    extra={
                        "source": d.source,
                        "owed_requests": d.owed_requests,
                        "endpoint": st.endpoint if st else None,
                        "mode": st.mode if st else None,
                        "connected": st.connected if st else None,
                        "hint": "vLLM connects its PUB out when its endpoint names a host: kvrouter check "
                        "tells which side must bind",
                    },
                )
                self.metrics.events_deaf.labels(d.source).set(1)
            for src in heard:
                log.warning("kv events: source heard again", extra={"source": src.label()})
                self.metrics.events_deaf.labels(src.label()).set(0)
            for name in self.event_sources.refused:
                self.metrics.events_refused.labels(name).set(1)

    def events_state(self) -> dict[str, object]:
        """For ``/health``: deaf sources and refused instances (empty when events are fine)."""
        return {
            "deaf": {d.source: msgspec.to_builtins(d) for d in self.pipeline.event_watch.deaf.values()},
            "refused": dict(self.event_sources.refused),
        }

    async def _startup_checks(self) -> None:
        """``kvrouter check`` at start-up, logged (token parity is the prober's: not checked twice)."""
        assert self.session is not None
        await self.event_sources.settled(timeout_s=10.0)
        held = (
            {st.endpoint for st in self.subscriber.status.values() if st.mode == "bind" and st.endpoint}
            if self.subscriber is not None
            else set()
        )
        reports = await check_fleet(
            self.cfg, self.pipeline, self.session, pool=self.pool, parity=False, held=held
        )
        for r in reports:
            for c in r.checks:
                level = logging.INFO if c.verdict in ("ok", "skip") else logging.WARNING
                log.log(
                    level,
                    "fleet check",
                    extra={"instance": r.instance, "check": c.name, "verdict": c.verdict, "detail": c.detail},
                )

    def closing(self) -> None:
        """The server stops taking connections: requests waiting for capacity are refused now (429,
        ``shutting_down``: another replica can take them) rather than cut off when the server stops."""
        n = self.pipeline.gate.close()
        if n:
            log.info("refused the requests waiting for capacity: shutting down", extra={"refused": n})

    async def stop(self) -> None:
        self.closing()
        if self.host_scrape is not None:
            self.host_scrape.stop()
        for task in (self._checks, self._watch):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.parity.stop()
        await self.event_sources.stop()
        await self.membership.stop()
        if self.shared is not None and self.leader:
            await self.shared.stop()
        if self.claims is not None:
            await self.claims.close()
        await self.pool.stop()
        if self.subscriber:
            await self.subscriber.stop()
        if self.warm is not None:
            await self.warm.stop(final=self.leader)
        self.http.close()
        if self.session:
            await self.session.close()
        await asyncio.get_running_loop().run_in_executor(None, self.telemetry.shutdown)  # flush spans
        self.lag.stop()
