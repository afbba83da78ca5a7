"""The router: from a request's block hashes to a target, within load limits.  Pure and clock-free.

::

    RouteInput ──Indexer.lookup_chains──▶ matches per (instance, rank) + trust
               ──LoadTracker────────────▶ in flight, queued prefill, decodes
               ──Policy.rank────────────▶ preference order ──limits──▶ Decision
    dispatched(): load accounting + speculative entries for the chosen target

The live gateway and the trace-driven simulator both call exactly this; neither has routing logic of
its own.  With several worker processes on one host, ``host`` carries the other workers' speculative
entries in before each decision and this worker's out after each dispatch, and the ``LoadTracker`` reads
the host's load (``kvrouter.host``): one view, the same decision as one process.
"""

from __future__ import annotations

from typing import Protocol

import msgspec
import numpy as np

from indexer import Indexer, InstanceMatch, LookupResult, SourceKey, Trust
from indexer.hashing import I64Array
from indexer.index import BlockIndex
from indexer.indexer import SpeculativeEntry

from ..types import InstanceId, RequestId, Role, TargetKey, target_key
from .isolation import Isolation, QuietTargets
from .load import InstanceLoad, LoadTracker
from .peer_prefill import PeerPrefill
from .placed_blocks import HostPlacement, PlacedBlocks
from .policies import (
    KV_AWARE,
    Candidate,
    LatencyBook,
    ModelStore,
    Observation,
    Policy,
    PolicySettings,
    RouteView,
    SessionTable,
)
from .policies.latency_model import received
from .saturation import Saturation
from .tier_value import DEFAULT_TIER_VALUES, OWN_TIERS, TierValues, credited_split

_EMPTY = np.zeros(0, dtype=np.int64)


class RouterConfig(msgspec.Struct, frozen=True):
    policy: str = KV_AWARE
    """Default policy (a name ``settings`` registers)."""
    model_policies: dict[str, str] = {}
    """Per-model policy overrides."""
    concurrency_threshold: int = 0
    """Requests in flight at which a target spills to the next-best one (0: no threshold)."""
    max_in_flight: int = 0
    """Hard cap per target; when every target is at it, requests wait (0: no cap)."""
    saturation: Saturation = Saturation()
    """The fleet's own signals of a full target, and the share of every limit kept for high priority."""
    isolation: Isolation = Isolation()
    """Quiet targets, kept from heavy flows (``routing.isolation``)."""
    speculative: bool = True
    """Record speculative index entries for dispatched requests, so a burst of a new prefix stays together."""
    shadow: bool = True
    """Ask every other policy what it would have chosen (metrics only)."""
    settings: PolicySettings = PolicySettings()
    """Every policy's settings; its fields register the policies this router knows (``policies.registry``).
    The fleet file's ``routing:`` section itself (``kvrouter.config.RoutingConfig`` derives from it)."""
    tiers: TierValues = DEFAULT_TIER_VALUES
    """Worth of a cached block per tier (``tier_value``: from load bandwidths in the fleet file's
    ``tiers:``); ``settings.kv_aware.offload_value``, when set, overrides every tier below the GPU."""


class Target(msgspec.Struct):
    """A routable (instance, rank) as the caller knows it right now."""

    instance: InstanceId
    dp_rank: int = 0
    dp_size: int = 1
    has_events: bool = True
    healthy: bool = True
    weight: float = 1.0
    role: Role = "both"
    """Its job for this request's model in a disaggregated fleet (``routing.disagg``)."""

    @property
    def key(self) -> TargetKey:
        return target_key(self.instance, self.dp_rank, self.dp_size)


_USABLE = frozenset(t.value for t in Trust if t.usable)


class RouteInput(msgspec.Struct):
    request_id: RequestId
    num_tokens: int
    chains: I64Array | None = None
    """Our chain hashes of the prompt's full blocks (None: no tokenizer, route by load/prefix only)."""
    prefix_key: bytes = b""
    model: str | None = None
    session: str | None = None
    """The session the request belongs to (the session policy keeps it on its target)."""
    reserved: bool = True
    """Whether it may fill the share of every limit kept for high priority (``Saturation.reserved``:
    set from its flow's priority and backlog before each decision)."""
    heavy: bool = False
    """Whether its flow is heavy now (``flows.meter``): it never goes to a quiet target
    (``routing.isolation``)."""
    quiet_open: bool = False
    """No flow needs the quiet targets now (``Isolation.idle_s``): any request takes any open target."""


def route_input(
    request_id: RequestId,
    *,
    chains: I64Array | None,
    num_tokens: int | None,
    prefix_text: str,
    affinity: str | None,
    model: str | None,
    prefix_length: int,
    session: str | None = None,
) -> RouteInput:
    """The one way a request becomes the router's input, for the gateway, the endpoint picker, the
    evaluator and the benchmarks alike: a different prefix key in one of them would make prefix-hash a
    different policy there.  ``prefix_text`` is the request's text as ``api.requests.prefix_text`` reads
    it; ``num_tokens`` None (no tokenizer) estimates four characters a token."""
    key = ((affinity or "") + "\x00" + prefix_text[:prefix_length]).encode()
    n = num_tokens if num_tokens is not None else max(1, len(prefix_text) // 4)
    return RouteInput(request_id, n, chains, key, model, session)


class ShadowChoice(msgspec.Struct):
    target: str
    cached_tokens: int


class Decision(msgspec.Struct):
    chosen: Candidate | None
    policy: str
    reason: str
    """cache (a cached prefix decided), load, affinity, session, spill, no_target, at_capacity"""
    ranked: list[Candidate]
    predicted_cached_tokens: int = 0
    """Prompt tokens vLLM is expected to report as cached on the chosen target (every tier in full)."""
    shadow: dict[str, ShadowChoice] = {}
    shadow_basis: tuple[RouteView, list[Candidate]] | None = None
    """What ``Router.shadow`` ranks when the caller deferred shadow scoring (``route(shadow=False)``)."""


class HostSync(Protocol):
    """What the other worker processes of this host did that the index must know (their speculative
    entries), and what this one did that they must (``kvrouter.host``)."""

    def pull(self) -> list[HostPlacement]:
        """Before a decision: apply the other workers' new speculative entries to this index; returns the
        new prompts they placed since (``placed``)."""

    def push(self) -> None:
        """After a dispatch: share this worker's new speculative entries."""

    def placed(self, source: SourceKey, blocks: int, now: float) -> None:
        """This worker placed a new prompt of ``blocks`` blocks at ``source``: the others count it in that
        target's share of new placements (``routing.placed_blocks``)."""

    def peers(self, entries: list[SpeculativeEntry]) -> None:
        """Other router replicas' entries this worker just took in (its round trip to them): the other
        workers take them in too, as those replicas' (``now`` is set so that ``now`` + the indexer's TTL
        is when each ends)."""


class Router:
    def __init__(
        self,
        indexer: Indexer,
        config: RouterConfig | None = None,
        *,
        load: LoadTracker | None = None,
        host: HostSync | None = None,
        peer_prefill: PeerPrefill | None = None,
        latency_store: ModelStore | None = None,
    ) -> None:
        """``load``: the tracker to count on (with several workers, one over the host's shared loads);
        ``host``: the other workers' speculative entries (None: one process); ``peer_prefill``: the other
        router replicas' queued prefill (None: no replicas share entries); ``latency_store``: where the
        latency models live when the host's workers learn them together (None: this process's own)."""
        self.indexer = indexer
        self.config = config or RouterConfig()
        self.load = load or LoadTracker()
        self.host = host
        self.peer_prefill = peer_prefill
        """Other router replicas' prefill not yet done per target, by the events (replicas sharing
        speculative entries): their reported queued prefill counts up to it."""
        self.placed = PlacedBlocks()
        """New prompts' blocks placed per target lately (this router's, its host's other workers' and, told
        by the claims log, other replicas'): the placement band's balance key."""
        self.quiet = QuietTargets(self.config.isolation)
        """Which targets heavy flows keep off (``isolation``)."""
        self.sessions = SessionTable(self.config.settings.session)
        self.latency = LatencyBook(self.config.settings.predicted_latency.model, latency_store)
        """Every target's latency models, fed by every whole request's dispatch, first token and end
        (``policies.latency_model``); the caller trains them off the request path (``latency.train``)."""
        self._policies: dict[str, Policy] = {}
        self.policy_names = self.config.settings.names()
        flat = self.config.settings.kv_aware.offload_value
        self.tier_values = self.config.tiers if flat is None else self.config.tiers.flat(flat)
        self.policy(self.config.policy)  # validates the name now
        for name in self.config.model_policies.values():
            self.policy(name)

    def policy(self, name: str) -> Policy:
        p = self._policies.get(name)
        if p is None:
            p = self._policies[name] = self.config.settings.build(name, self.sessions, self.latency)
        return p

    def policy_for(self, model: str | None) -> Policy:
        name = self.config.model_policies.get(model or "", self.config.policy)
        return self.policy(name)

    # ------------------------------------------------------------------ candidates
    def candidates(
        self,
        inp: RouteInput,
        targets: list[Target],
        now: float | None = None,
        remote: LookupResult | None = None,
    ) -> list[Candidate]:
        """Every healthy target with its predicted cached tokens and load.  ``remote``: a lookup answered by
        a remote indexer (events are indexed there); this router's own speculative entries still count."""
        if self.host is not None:
            self._host_placed(self.host.pull(), targets)
        if self.load.shared is not None:
            self.load.refresh([t.key for t in targets if t.healthy])
        bs = self.indexer.block_size
        max_hit = max(0, (inp.num_tokens - 1) // bs)  # vLLM always recomputes the last prompt token
        matches: dict[tuple[str, int], InstanceMatch] = {}
        stores: dict[str, str] = {}
        if inp.chains is not None and len(inp.chains):
            res = self.indexer.lookup_chains(inp.chains, inp.num_tokens, now=now)
            matches = {(m.instance, m.dp_rank): m for m in res.instances}
            stores = res.stores
        if remote is not None:
            local = matches
            matches = {
                (m.instance, m.dp_rank): _merge_remote(m, local.get((m.instance, m.dp_rank)))
                for m in remote.instances
            }
            stores = remote.stores
        unusable = frozenset(n for n, t in stores.items() if t not in _USABLE)
        values = self.tier_values
        limit = self.config.concurrency_threshold
        out: list[Candidate] = []
        for t in targets:
            if not t.healthy:
                continue
            key = t.key  # (a property that builds the key: read once per target)
            load = self.load.get(key)
            in_flight = load.effective_in_flight()
            c = Candidate(
                t.instance,
                t.dp_rank,
                key,
                in_flight=in_flight,
                others_in_flight=max(0, in_flight - load.in_flight),
                pending_prefill_tokens=load.pending_prefill_tokens + self._peers_prefill(t, load, now),
                decoding=max(load.decoding, load.engine_running - load.prefilling),
                kv_usage=load.engine_kv_usage,
                weight=t.weight,
            )
            m = matches.get((t.instance, t.dp_rank))
            src = SourceKey(t.instance, t.dp_rank)
            c.footprint = self.indexer.footprint(src)
            if now is not None:
                self.placed.cleared(key, self.indexer.clears(src), now)
                c.placed_blocks = self.placed.blocks(key, now)
            if t.has_events:
                c.trust = m.trust if m else self.indexer.trust(src).value
            if m and t.has_events and c.trust in _USABLE:
                split = credited_split(m.tiers, m.speculative_blocks, max_hit, unusable)
            elif m:
                # An untrusted index earns no credit for the target's own tiers; the router's own
                # speculative entries (requests it sent there itself) still do, so a burst sticks together
                # even on a fleet still cold, and so do shared stores (their trust is their own: a cold
                # instance attached to a store can load what the others wrote there).
                shared = {k: n for k, n in m.tiers.items() if k not in OWN_TIERS}
                split = credited_split(shared, m.speculative_blocks, max_hit, unusable)
            else:
                split = {}
            if split:
                c.tiers = split
                c.gpu_blocks = split.get("GPU", 0)
                c.speculative_blocks = split.get("speculative", 0)
                c.matched_blocks = sum(split.values())
                c.offload_blocks = c.matched_blocks - c.gpu_blocks - c.speculative_blocks
                c.hit_tokens = c.matched_blocks * bs
                c.cached_tokens = round(sum(values.of(k) * n for k, n in split.items()) * bs)
            c.saturated = bool(limit) and in_flight >= limit
            out.append(c)
        return out

    def _peers_prefill(self, t: Target, load: InstanceLoad, now: float | None) -> int:
        """Other replicas' queued prefill at ``t``: their reports, as of their last round trip, capped by
        what their speculative entries there still have to compute (``PeerPrefill``)."""
        reported = load.external_prefill_tokens
        if not reported or self.peer_prefill is None:
            return reported
        return min(reported, self.peer_prefill.tokens(SourceKey(t.instance, t.dp_rank), now, self.indexer))

    # ------------------------------------------------------------------ deciding
    def route(
        self,
        inp: RouteInput,
        targets: list[Target],
        now: float | None = None,
        *,
        dry_run: bool = False,
        remote: LookupResult | None = None,
        shadow: bool = True,
    ) -> Decision:
        """Choose a target.  ``dry_run`` (explain) leaves every policy's state as it was.

        ``shadow=False`` defers shadow scoring: the decision keeps what it needs, and ``shadow(d)`` fills
        ``d.shadow`` later.  The gateway does that once the request is on its way upstream, so the time
        of asking four other policies is not part of any request's latency."""
        return self.route_among(
            inp, self.candidates(inp, targets, now, remote), now=now, dry_run=dry_run, shadow=shadow
        )

    def route_among(
        self,
        inp: RouteInput,
        cands: list[Candidate],
        *,
        now: float | None = None,
        policy: Policy | None = None,
        dry_run: bool = False,
        shadow: bool = True,
    ) -> Decision:
        """``route`` over candidates already built (``candidates``), ranked by ``policy`` (default: the
        model's).  A disaggregated plan looks the prompt up once and ranks its pools from the same
        candidates (``routing.disagg``); the candidates' scores are overwritten."""
        policy = policy or self.policy_for(inp.model)
        if not cands:
            return Decision(None, policy.name, "no_target", [])
        view = RouteView(inp.num_tokens, inp.prefix_key, inp.session, now, chains=inp.chains)
        cap, sat = self.config.max_in_flight, self.config.saturation
        open_ = [c for c in cands if sat.full(c, cap, inp.reserved) is None]
        if not inp.quiet_open:
            open_ = self.quiet.lane(open_, cands, inp.heavy)
        if not open_:
            return Decision(None, policy.name, "at_capacity", policy.rank(view, cands, dry_run=True))
        ranked = policy.rank(view, open_, dry_run=dry_run)
        chosen = next((c for c in ranked if not c.saturated), ranked[0])
        reason = policy.reason(chosen) if chosen is ranked[0] else "spill"
        d = Decision(chosen, policy.name, reason, ranked, predicted_cached_tokens=chosen.hit_tokens)
        if self.config.shadow:
            if shadow:
                d.shadow = self._shadow(view, open_, policy.name)
            else:
                d.shadow_basis = (view, open_)
        return d

    def shadow(self, d: Decision) -> dict[str, ShadowChoice]:
        """Fill in a deferred decision's shadow choices (once; later calls return them).  The candidates
        are the decision's own snapshot, so this request's dispatch and other requests' loads do not
        change the answer; a policy's own state (round-robin's pointer) is read as it is now."""
        if d.shadow_basis is not None:
            view, cands = d.shadow_basis
            d.shadow_basis = None
            d.shadow = self._shadow(view, cands, d.policy)
        return d.shadow

    def _shadow(self, view: RouteView, cands: list[Candidate], active: str) -> dict[str, ShadowChoice]:
        # Policies only write ``score``: rank the same candidates (a new list each time, as ranking
        # reorders it) and put the active policy's scores back, instead of copying every candidate.
        scores = [c.score for c in cands]
        out: dict[str, ShadowChoice] = {}
        for name in self.policy_names:
            if name == active:
                continue
            ranked = self.policy(name).rank(view, list(cands), dry_run=True)
            pick = next((c for c in ranked if not c.saturated), ranked[0])
            out[name] = ShadowChoice(pick.target, pick.hit_tokens)
        for c, sc in zip(cands, scores):
            c.score = sc
        return out

    # ------------------------------------------------------------------ accounting
    def new_prefix(self, inp: RouteInput) -> bool:
        """No target holds the prompt's first block, stored or expected (a local index only): placing it
        is a choice the router makes from its view of the load alone."""
        chains = inp.chains
        index = self.indexer.index
        if chains is None or not len(chains) or not isinstance(index, BlockIndex):
            return False
        return not index.held_by_any(int(chains[0]))

    def placed_new(self, chains: I64Array, at: Candidate, now: float, *, share: bool = False) -> None:
        """A prompt no target held was placed at ``at`` (by this router, or by another replica as the
        claims log tells): its blocks count in ``at``'s share of new placements for the window.  ``share``:
        the other workers of this host count it too (they learn it no other way: no claims log)."""
        src = SourceKey(at.instance, at.dp_rank)
        self.placed.cleared(at.target, self.indexer.clears(src), now)
        self.placed.add(at.target, len(chains), now)
        if share and self.host is not None:
            self.host.placed(src, len(chains), now)

    def _host_placed(self, got: list[HostPlacement], targets: list[Target]) -> None:
        """The other workers' placements of new prompts, counted here (on a target this caller knows)."""
        if not got:
            return
        keys: dict[tuple[str, int], TargetKey] = {(t.instance, t.dp_rank): t.key for t in targets}
        for p in got:
            key = keys.get((p.source.instance, p.source.dp_rank))
            if key is not None:
                self.placed.add(key, p.blocks, p.now)

    def expect(self, chains: I64Array, at: Candidate, now: float) -> None:
        """Another router replica has placed, or is placing, a prompt whose blocks are ``chains`` at ``at``
        (its claim, or its entry in the placements log): expect them there as a speculative entry of this
        index alone (that replica publishes its own)."""
        if len(chains) and isinstance(self.indexer.index, BlockIndex):
            src = SourceKey(at.instance, at.dp_rank)
            self.indexer.index.add_speculative(src, chains, now=now, ttl=self.indexer.speculative_ttl)

    def dispatched(
        self,
        inp: RouteInput,
        chosen: Candidate,
        now: float,
        *,
        request_id: RequestId | None = None,
        prefill_tokens: int | None = None,
    ) -> None:
        """The request was sent to ``chosen``: account its load and expect its blocks there.

        ``request_id``: the id its load is accounted under (default the request's; a disaggregated
        request's prefill leg has its own, ``types.leg_id``).  ``prefill_tokens``: what it computes there
        (default: the prompt minus what ``chosen`` caches; a decode leg receives its prompt instead).

        Only the blocks past those the index already holds there become speculative entries: an entry
        for a stored block would outlive its eviction (entries end when confirmed or expired, and a block
        already stored is confirmed only by being stored again), and claim it held for up to the TTL."""
        whole = prefill_tokens is None
        if prefill_tokens is None:
            # The valued credit, not the hit: a block loaded from a slower tier still costs its load time,
            # counted in prefill-token equivalents (``tier_value``).
            prefill_tokens = max(0, inp.num_tokens - chosen.cached_tokens)
        if whole:  # a whole request, or a prefill leg (its first token ends it: its TTFT is the leg's)
            self.latency.dispatched(request_id or inp.request_id, inp.num_tokens, chosen, now)
        elif request_id is None:  # a decode leg: it receives the prompt; its pace is observed, not its TTFT
            self.latency.dispatched(
                inp.request_id, inp.num_tokens, received(chosen, inp.num_tokens), now, ttft=False
            )
        self.load.dispatch(request_id or inp.request_id, chosen.target, prefill_tokens)
        if inp.session is not None:
            self.sessions.record(inp.session, chosen.target, now)
        if self.config.speculative and inp.chains is not None:
            new = inp.chains[chosen.gpu_blocks + chosen.offload_blocks :]
            if len(new):
                self.indexer.add_speculative(SourceKey(chosen.instance, chosen.dp_rank), new, now=now)
                if self.host is not None:
                    self.host.push()

    def claim(self, rid: RequestId, chosen: Candidate, reserved: bool = True) -> bool:
        """Take a slot for ``rid`` on ``chosen`` before it is dispatched there, when ``max_in_flight``
        caps the targets (always True without a cap); not ``reserved``: it sees the cap less the
        reserve.  False: another worker process of the host took the last one since this
        decision read the loads."""
        cap = self.config.saturation.cap(self.config.max_in_flight, reserved)
        return not cap or self.load.claim(rid, chosen.target, cap)

    def first_token(
        self, rid: RequestId, now: float | None = None, *, streamed: bool = True
    ) -> Observation | None:
        """``rid``'s first token reached the router at ``now`` (None: no clock, nothing observed): its
        prefill load ends; its TTFT against the prediction, queued for ``latency.train``.  Not
        ``streamed``: its whole answer came at once; nothing of its latency is observed (``unary``)."""
        self.load.first_token(rid)
        if not streamed:
            return self.latency.unary(rid)
        return None if now is None else self.latency.first_token(rid, now)

    def finished(
        self, rid: RequestId, now: float | None = None, output_tokens: int | None = None
    ) -> Observation | None:
        """``rid`` ended (answered, failed or abandoned) at ``now``: its load goes; with ``output_tokens``
        known, its TPOT against the prediction, queued for ``latency.train``."""
        self.load.finish(rid)
        if now is None:
            self.latency.forget(rid)
            return None
        return self.latency.finished(rid, now, output_tokens)

    def predict(self, num_tokens: int, cands: list[Candidate]) -> None:
        """Fill in every candidate's predicted TTFT and TPOT (explain, whatever the policy)."""
        for c in cands:
            c.predicted_ttft_s, c.predicted_tpot_s = self.latency.predict(num_tokens, c)

    @staticmethod
    def no_chains() -> I64Array:
        return _EMPTY


def _merge_remote(remote: InstanceMatch, local: InstanceMatch | None) -> InstanceMatch:
    """A remote indexer's match, extended by this router's speculative entries for the same target."""
    spec = local.speculative_blocks if local else 0
    if spec <= remote.matched_blocks:
        return remote
    return msgspec.structs.replace(
        remote, matched_blocks=spec, speculative_blocks=spec - remote.matched_blocks
    )
