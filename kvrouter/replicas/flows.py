"""One queue, one set of flow accounts and one set of rate limits over every router replica, as pure
values: no I/O; the replicas' round trip (``SharedState``) carries them.

::

    board (host.QueueBoard | flows.ProcessBoard) ── request() ─▶ SyncRequest.queue, .counts
      waiting, best waiters' (group, priority)         QueueWire: {waiting, tops [(group, priority)]}
      flows.served_changed() (else .served())         counts: "s:<priority>:<tenant>" service,
      flows.counted()                                          "r:<tenant>" / "t:<tenant>" requests / tokens
    board.set_peers(waiting, tops)   ◀─ apply(reply) ◀─ SyncReply.peer_queues, .totals (service summed
    flows.set_external(peers' service)                  over replicas, changed since .totals_since),
                                                        .peer_use (each live peer's)
    RateLimiter.debit(what each peer's use grew by)

Invariants:

- A running total is published whole (never a delta), so a round trip repeated after a lost reply counts
  nothing twice; the service peers gave = the store's sum minus what this replica last published.  After
  an outage everything is published again (the store may have restarted empty).
- Between replicas, only a higher priority waiting for the same group defers a waiter
  (``pipeline.gate``): what a peer shows is a round trip old, and capacity left for a peer's waiter
  stays idle until the peer hears of it, so the two could otherwise each wait for the other.
- Peers' rate use is taken from the buckets as it grows, per peer: what a peer had taken when this
  replica first saw it live is not (a starting replica may let through up to one more minute's
  allowance), and a peer's use republished after the store lost it counts only what grew since.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import msgspec

from ..flows import BucketStore, Flow, FlowAccounts, RateLimiter


class TopWire(msgspec.Struct, array_like=True, frozen=True):
    """One of a replica's best waiters: its group (``str`` of the gate's: model and pin) and priority."""

    group: str
    priority: int


class QueueWire(msgspec.Struct, array_like=True, frozen=True):
    waiting: int
    tops: list[TopWire]


class Board(Protocol):
    """The queue's board this replica's gate uses (``host.QueueBoard`` or ``flows.ProcessBoard``)."""

    @property
    def flows(self) -> _Flows: ...

    def waiting_total(self) -> int: ...

    def peers_waiting(self) -> int: ...

    def own_tops(self) -> list[tuple[str, int]]: ...

    def set_peers(self, waiting: int, tops: list[tuple[str, int]]) -> None: ...


class _Flows(FlowAccounts, BucketStore, Protocol):
    pass


FULL_EVERY = 200
"""Every this many replies, ask for every service total rather than those changed (10 s at the default
interval): a sum changed without a version (a replica of an older release, during a rolling upgrade) or
a version key evicted alone would otherwise stay unseen.  Costs 1/200 of reading them all each time."""
FORGET_S = 600.0
"""A peer not seen for this long is forgotten (its use, if it comes back, is its new baseline)."""
_ENC = msgspec.msgpack.Encoder()
_QUEUE = msgspec.msgpack.Decoder(QueueWire)


def service_key(flow: Flow) -> str:
    return f"s:{flow.priority}:{flow.tenant}"


class ReplicaFlows:
    """The flows' share of one replica's round trip (owned by the event loop's thread of the worker that
    syncs); ``on_peers``: called once the peers' part changed (the gate looks for capacity again)."""

    def __init__(
        self,
        board: Board,
        rate: RateLimiter,
        *,
        on_peers: Callable[[], None] | None = None,
    ) -> None:
        self.board = board
        self.rate = rate
        self.on_peers = on_peers
        self.sent: dict[str, float] = {}
        """Each running total as the store holds it for this replica (last published)."""
        self._sending: dict[str, float] = {}
        self._peer_use: dict[str, tuple[float, dict[str, float]]] = {}
        """Each peer's rate use as last taken from the buckets, and when it was last seen."""
        self.since = ""
        """Where the store's service totals stood at the last reply (``SyncReply.totals_at``): the next
        reply carries only those changed since ("": every one)."""
        self._external: dict[Flow, float] = {}
        """Each flow's service given by the other replicas, as the replies have told it."""
        self._replies = 0
        self._whole = True
        """The next request reads every service total here (start, resync; or accounts that do not keep
        what changed), not only the flows charged since."""
        self._unsent: dict[str, float] = {}
        """Service totals read as changed and not yet known to be published."""
        self._republish = False
        """The next request publishes every total, changed or not (``resync``)."""
        self.decode_errors = 0

    def totals(self) -> dict[str, float]:
        return self._with_use({service_key(f): v for f, v in self.board.flows.served().items()})

    def _with_use(self, out: dict[str, float]) -> dict[str, float]:
        """``out`` and this replica's rate use per tenant (configured limits only: few)."""
        for tenant, (requests, tokens) in self.board.flows.counted().items():
            out[f"r:{tenant}"] = requests
            out[f"t:{tenant}"] = tokens
        return out

    def _changed(self) -> dict[str, float]:
        """The totals that may have changed: every one, or the service of the flows charged since the last
        request (with what an unanswered request carried) and the rate use (configured tenants only)."""
        changed = self.board.flows.served_changed()
        if self._whole or changed is None:
            self._whole = changed is None
            out = self.totals()
            for k in (*self.sent, *self._unsent):
                if k.startswith("s:") and k not in out:
                    out[k] = 0.0  # a flow forgotten here: its total leaves the store's sums
            # kept until published: a round trip that neither succeeds nor fails (this process stalled)
            # leaves them to the next request
            self._unsent = {k: v for k, v in out.items() if k.startswith("s:")}
            return out
        self._unsent.update((service_key(f), v) for f, v in changed.items())
        return self._with_use(dict(self._unsent))

    def request(self) -> tuple[bytes, list[tuple[str, float]]]:
        """What this replica publishes: its waiters (b"" when none) and its changed running totals."""
        waiting = self.board.waiting_total()
        tops = [TopWire(g, p) for g, p in self.board.own_tops()]
        queue = _ENC.encode(QueueWire(waiting, tops)) if waiting or tops else b""
        self._sending = self._changed()
        if self._republish:
            return queue, list(self._sending.items())
        # (a flow forgotten here is published as 0 once, if the store holds a total of it)
        return queue, [
            (k, v) for k, v in self._sending.items() if self.sent.get(k, 0.0 if v == 0 else None) != v
        ]

    def published(self) -> None:
        self.sent.update(self._sending)
        for k, v in self._sending.items():
            if v == 0 and k.startswith("s:"):
                del self.sent[k]  # the store dropped it too
        self._unsent = {}
        self._republish = False

    def resync(self) -> None:
        """Publish every total again at the next round trip and read every one (the store may have lost
        them).  What was sent is kept, so that a total no longer held here is published as 0."""
        self._republish = True
        self.since = ""
        self._whole = True

    def apply(
        self,
        peer_queues: list[tuple[int, bytes]],
        totals: dict[str, float],
        peer_use: dict[str, dict[str, float]],
        now_s: float,
        *,
        totals_at: str = "",
        totals_full: bool = True,
    ) -> None:
        """Peers' service joins the flows' counters, their rate use leaves the buckets, their waiters join
        the board (``SyncReply``'s fields; ``now_s``: the rate limiter's clock).  ``totals``: every
        service total (``totals_full``) or those changed since the last reply (each one this replica
        published this round among them, so what it sent is subtracted afresh)."""
        if totals_full:
            self._external = {}
        self._replies += 1
        self.since = totals_at if self._replies % FULL_EVERY else ""
        for key, total in totals.items():
            prio, _, tenant = key[2:].partition(":")
            try:
                flow = Flow(tenant, int(prio))
            except ValueError:
                self.decode_errors += 1
                continue
            peers = total - self.sent.get(key, 0.0)
            if peers > 0:
                self._external[flow] = peers
            else:  # none, or a sum the store dropped: every replica forgot the flow
                self._external.pop(flow, None)
        self.board.flows.set_external(self._external)
        for peer, use in peer_use.items():
            before = self._peer_use.get(peer)
            if before is None:  # its use until now is not known to be recent: not taken
                self._peer_use[peer] = (now_s, dict(use))
                continue
            seen = before[1]
            grew: dict[str, list[float]] = {}
            for key, v in use.items():
                d = v - seen.get(key, 0.0)
                if d > 0 and key[:2] in ("r:", "t:"):
                    grew.setdefault(key[2:], [0.0, 0.0])[key[0] == "t"] += d
                    seen[key] = v  # a peer's use only grows: what a restarted store lacks is kept
            self._peer_use[peer] = (now_s, seen)
            for tenant, (requests, tokens) in grew.items():
                self.rate.debit(tenant, requests, tokens, now_s)
        if len(self._peer_use) > len(peer_use):  # replicas gone long ago are forgotten
            self._peer_use = {p: u for p, u in self._peer_use.items() if now_s - u[0] < FORGET_S}
        waiting = 0
        tops: set[tuple[str, int]] = set()
        for _, raw in peer_queues:
            try:
                q = _QUEUE.decode(raw)
            except msgspec.DecodeError:
                self.decode_errors += 1
                continue
            waiting += q.waiting
            tops.update((t.group, t.priority) for t in q.tops)
        self.board.set_peers(waiting, sorted(tops, key=lambda t: (-t[1], t[0])))
        if self.on_peers is not None:
            self.on_peers()

    def forget_peers(self) -> None:
        """The store is unreachable past a lease: no peer's waiter is waited for."""
        self.board.set_peers(0, [])
        if self.on_peers is not None:
            self.on_peers()
