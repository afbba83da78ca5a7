"""Several router replicas in the virtual fleet: a round-robin client, every replica fed every event.

::

    request k ──round robin──▶ replica k mod N (its own Router + Indexer) ──▶ engines (VirtualFleet)
    engine events ──▶ every replica's Indexer (each subscribes to every instance)
    every interval_s (staggered per replica): ReplicaState.request ─▶ MemoryReplicaHub ─▶ ReplicaState.apply

The hub is ``MemoryReplicaHub`` on the virtual clock: the same leases, stream, cursors and TTL arithmetic
as ``RedisReplicaStore`` (one behaviour suite covers both), so the figures measure the sharing scheme
itself, round trips apart.  With ``share=False`` replicas see only their own traffic (the failure peers
report); with one replica this is ``VirtualFleet`` itself.
"""

from __future__ import annotations

from functools import partial

import msgspec

from indexer import Indexer, SourceKey
from indexer.hashing import I64Array
from kvrouter.lab.evaluation.virtual_fleet import FleetSimConfig, VirtualFleet
from kvrouter.lab.workloads.blocks import BlockContentCache
from kvrouter.lab.workloads.spec import Workload
from kvrouter.replicas.state import ReplicaState, SyncReply
from kvrouter.replicas.store import MemoryReplicaHub
from kvrouter.routing import RouteInput, Router, RouterConfig
from kvrouter.routing.load import InstanceLoad
from kvrouter.routing.policies import Candidate, Observation
from kvrouter.routing.router import Decision, Target
from kvrouter.types import RequestId, TargetKey


class ReplicaSimConfig(msgspec.Struct, frozen=True):
    replicas: int = 4
    share: bool = True
    """Share in-flight load and speculative entries through the hub (False: each replica on its own)."""
    interval_s: float = 0.05
    """Each replica's round trip period (as ``SharedStateConfig.interval_s``)."""
    rtt_s: float = 0.001
    """Round trip to the store: a reply is taken in this long after the request left."""
    lease_s: float = 2.0
    window_s: float = 10.0


class _SummedLoad:
    """What ``VirtualFleet._sample`` reads: in flight per instance over all replicas."""

    def __init__(self, routers: list[Router]) -> None:
        self.routers = routers

    def get(self, inst: TargetKey) -> InstanceLoad:
        return InstanceLoad(in_flight=sum(r.load.get(inst).in_flight for r in self.routers))


class _EveryReplicaLatency:
    def __init__(self, routers: list[Router]) -> None:
        self.routers = routers

    def train(self) -> None:
        for r in self.routers:
            r.latency.train()


class ReplicaRouters:
    """Stands where ``VirtualFleet`` keeps its router: each request sticks to the replica that took it."""

    def __init__(self, routers: list[Router]) -> None:
        self.routers = routers
        self.load = _SummedLoad(routers)
        self._of: dict[str, Router] = {}
        self._next = 0

    def replica(self, rid: str) -> Router:
        r = self._of.get(rid)
        if r is None:
            r = self._of[rid] = self.routers[self._next % len(self.routers)]
            self._next += 1
        return r

    def route(
        self, inp: RouteInput, targets: list[Target], now: float | None = None, *, dry_run: bool = False
    ) -> Decision:
        return self.replica(inp.request_id).route(inp, targets, now, dry_run=dry_run)

    def dispatched(self, inp: RouteInput, chosen: Candidate, now: float) -> None:
        self.replica(inp.request_id).dispatched(inp, chosen, now)

    def first_token(self, rid: RequestId, now: float | None = None) -> Observation | None:
        return self.replica(rid).first_token(rid, now)

    def finished(
        self, rid: RequestId, now: float | None = None, output_tokens: int | None = None
    ) -> Observation | None:
        return self.replica(rid).finished(rid, now, output_tokens)

    @property
    def latency(self) -> _EveryReplicaLatency:
        """What ``VirtualFleet`` trains: each replica's own latency models (they learn apart)."""
        return _EveryReplicaLatency(self.routers)

    @staticmethod
    def no_chains() -> I64Array:
        return Router.no_chains()


class ReplicatedFleet(VirtualFleet):
    def __init__(
        self,
        workload: Workload,
        cfg: FleetSimConfig,
        router_cfg: RouterConfig,
        replicas: ReplicaSimConfig,
        *,
        hashes: BlockContentCache | None = None,
    ) -> None:
        super().__init__(workload, cfg, router_cfg, hashes=hashes)
        self.rcfg = replicas
        self.indexers = [self.indexer] + [Indexer(cfg.block_size) for _ in range(replicas.replicas - 1)]
        for ix in self.indexers[1:]:
            for n in self.names:
                ix.register(SourceKey(n, 0))
        # The plain Router: its candidates already count peers' in-flight and queued prefill
        # (``InstanceLoad.effective_*``); a subclass that added the prefill again counted it twice.
        self.routers: list[Router] = [Router(ix, router_cfg) for ix in self.indexers]
        self.router = ReplicaRouters(self.routers)  # type: ignore[assignment]
        self.hub = MemoryReplicaHub(lambda: self.clock.now)
        self.states = [ReplicaState(r, f"replica-{i}") for i, r in enumerate(self.routers)]
        if replicas.share and replicas.replicas > 1:
            for i, ix in enumerate(self.indexers):
                ix.speculative_outbox = []
                self.clock.at(replicas.interval_s * i / replicas.replicas, partial(self._sync, i))

    def _sync(self, i: int) -> None:
        now, c = self.clock.now, self.rcfg
        st = self.states[i]
        reply = self.hub.sync_now(st.request(now, lease_s=c.lease_s, window_s=c.window_s, max_read=100_000))
        self.clock.at(now + c.rtt_s, partial(self._reply, i, reply))

    def _reply(self, i: int, reply: SyncReply) -> None:
        now = self.clock.now
        st = self.states[i]
        st.published()
        st.apply(reply, now)
        if self.finished < len(self.workload.requests) and self.clock.pending():
            self.clock.at(now - self.rcfg.rtt_s + self.rcfg.interval_s, partial(self._sync, i))

    def _deliver(self, name: str, seq: int, payload: bytes) -> None:
        for ix in self.indexers:
            if self.cfg.event_loss:
                ix.on_message(SourceKey(name, 0), seq, payload)
            else:
                ix.apply_payload(name, payload)
