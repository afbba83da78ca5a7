"""The queue of requests waiting for capacity, as flows: served highest priority first and, within a
priority, the flow with the least service counted so far; shed lowest priority first.  Pure: no clock,
no I/O.  One instance lives in each front door's ``pipeline.CapacityGate`` and in the evaluator's fleet.

    push(w) -> queues[(priority, tenant)] FIFO; best() -> the head of the flow ranked first by
    (-priority, counter, ticket) (fifo: ticket); charge(flow, cost): counter += cost / weight

Invariants:

- A flow that becomes backlogged has its counter lifted to the least counter of the backlogged flows of
  its priority (none: the priority's virtual time, the greatest counter charged there), so idle time is
  never banked as credit.
- When the queue is full, a newcomer displaces the newest waiter of the flow ranked last among those it
  outranks: a lower priority first, then (not ``fifo``) a flow of its own priority with more service.
  Otherwise the newcomer is refused.  A flow of priority below 0 never waits.  (docs/flows.md)
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, Protocol, TypeVar

from .config import DEFAULT_MAX_FLOWS, Fairness

T = TypeVar("T")


class Flow(NamedTuple):
    """A tenant at a priority: the unit that is queued, counted and shared fairly."""

    tenant: str
    priority: int


class Refused(Exception):
    """The newcomer may not wait: ``queue_full`` (it outranks no waiter) or ``sheddable`` (priority < 0)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(eq=False, slots=True)
class Waiter(Generic[T]):
    item: T
    flow: Flow
    ticket: int
    """Arrival order (smaller: earlier); unique among waiters."""
    group: Hashable = None
    """What capacity it needs (its model): a head that cannot be served makes its group's wait."""
    extra: dict[str, object] = field(default_factory=dict)


def request_cost(fairness: Fairness, prompt_tokens: int, cached_tokens: int, output_tokens: int) -> float:
    """What admitting a request charges its flow: ``requests`` one, ``vtc`` every prompt and output
    token, ``work`` (and ``fifo``, whose counters are kept for the metrics only) the tokens the fleet
    computes: the prompt tokens not cached where it goes, and its decode."""
    if fairness == "requests":
        return 1.0
    if fairness == "vtc":
        return float(prompt_tokens + output_tokens)
    return float(max(0, prompt_tokens - cached_tokens) + output_tokens)


class FlowAccounts(Protocol):
    """The flows' counters, the priorities' virtual times and who is backlogged: this process's
    (``LocalAccounts``) or the host's, shared by its worker processes (``kvrouter.host.HostFlows``)."""

    def counter(self, flow: Flow) -> float: ...

    def lift(self, flow: Flow, own_waiting: Mapping[Flow, int]) -> float:
        """The counter ``flow`` would have on becoming backlogged (nothing changes)."""

    def set_counter(self, flow: Flow, value: float) -> None: ...

    def charge(self, flow: Flow, amount: float) -> None:
        """The priority's virtual time rises to the flow's counter, which grows by ``amount`` (atomically
        where several processes charge)."""

    def set_waiting(self, flow: Flow, n: int) -> None:
        """This process's waiters of ``flow`` (the host's accounts see every process's backlog)."""

    def waiting(self, flow: Flow, own: int) -> int:
        """Waiters of ``flow`` in every process sharing these accounts (``own``: this process's)."""

    def served(self) -> dict[Flow, float]:
        """Service charged here (this process, or every worker of the host) per flow since start: what other
        router replicas add to their counters (``kvrouter.replicas.flows``)."""

    def set_external(self, service: Mapping[Flow, float]) -> None:
        """Service other router replicas gave each flow (a flow not named: none); a flow's counter counts
        it from now on."""

    def served_changed(self) -> dict[Flow, float] | None:
        """``served()`` of the flows charged since the last call only (None: not kept; read ``served()``).
        What lets a replica publish what changed without reading every tenant's total."""

    def census(self) -> tuple[int, int] | None:
        """(flows with an account, flows forgotten past the bound so far) for ``kvrouter_flow_accounts``
        and ``..._forgotten_total``; None where another process reports them."""


class LocalAccounts:
    """``FlowAccounts`` of one process, holding at most ``max_flows`` flows' counters.

    Beyond it the least recently charged flow without waiters is forgotten: it comes back as a new flow
    (lifted to its priority's base like any flow that becomes backlogged), and its running total is
    published as 0, so the replicas' sums drop it too.  Forgetting is exact for a flow whose counter is at
    most the base it would be lifted to; otherwise its lead over the others (service given before at least
    ``max_flows`` other flows were charged) is forgotten with it."""

    def __init__(self, max_flows: int = DEFAULT_MAX_FLOWS) -> None:
        if max_flows < 1:
            raise ValueError("max_flows must be >= 1")
        self.max_flows = max_flows
        self.counters: dict[Flow, float] = {}
        """Service counted per flow (cost / weight), lifted as the invariant says; without ``external``."""
        self.vtime: dict[int, float] = {}
        """Per priority: the greatest counter a charge found there."""
        self.own: dict[Flow, float] = {}
        """Service charged here, per flow, since it was last forgotten (never lifted)."""
        self.external: dict[Flow, float] = {}
        """Service other router replicas gave each flow."""
        self._changed: set[Flow] | None = None
        """Flows charged (or forgotten) since the last ``served_changed``; None until it is first called
        (one router alone never calls it, and would keep every flow here)."""
        self._recent: OrderedDict[Flow, None] = OrderedDict()
        """The flows of ``counters``, least recently charged or lifted first."""
        self._waiting: set[Flow] = set()
        """Flows with waiters here: never forgotten."""
        self.forgotten = 0

    def census(self) -> tuple[int, int] | None:
        return len(self.counters), self.forgotten

    def counter(self, flow: Flow) -> float:
        return self.counters.get(flow, 0.0) + self.external.get(flow, 0.0)

    def lift(self, flow: Flow, own_waiting: Mapping[Flow, int]) -> float:
        peers = [self.counter(f) for f, n in own_waiting.items() if n and f.priority == flow.priority]
        base = min(peers) if peers else self.vtime.get(flow.priority, 0.0)
        return max(self.counter(flow), base)

    def set_counter(self, flow: Flow, value: float) -> None:
        self.counters[flow] = value - self.external.get(flow, 0.0)
        self._touch(flow)

    def charge(self, flow: Flow, amount: float) -> None:
        self.vtime[flow.priority] = max(self.vtime.get(flow.priority, 0.0), self.counter(flow))
        self.counters[flow] = self.counters.get(flow, 0.0) + amount
        self.own[flow] = self.own.get(flow, 0.0) + amount
        if self._changed is not None:
            self._changed.add(flow)
        self._touch(flow)

    def _touch(self, flow: Flow) -> None:
        self._recent[flow] = None
        self._recent.move_to_end(flow)
        if len(self._recent) <= self.max_flows:
            return
        # Each call adds at most one flow, so forgetting one keeps the bound (unless every other flow
        # waits).  The waiting flows passed over are few: no more than the queue holds.
        old = next((f for f in self._recent if f not in self._waiting and f != flow), None)
        if old is None:
            return
        del self._recent[old]
        self.counters.pop(old, None)
        if self.own.pop(old, None) is not None and self._changed is not None:
            self._changed.add(old)  # published as 0: its share leaves the replicas' sums
        self.forgotten += 1

    def set_waiting(self, flow: Flow, n: int) -> None:
        # the queue's own table is the only backlog; kept here so a waiting flow is never forgotten
        if n:
            self._waiting.add(flow)
        else:
            self._waiting.discard(flow)

    def waiting(self, flow: Flow, own: int) -> int:
        return own

    def served(self) -> dict[Flow, float]:
        return dict(self.own)

    def set_external(self, service: Mapping[Flow, float]) -> None:
        # kept, not copied (a copy cost 2.7 ms a round trip at 100,000 flows): the replicas' sync owns the
        # map, updates it in place and calls this again, on this same thread
        self.external = service if isinstance(service, dict) else dict(service)

    def served_changed(self) -> dict[Flow, float] | None:
        if self._changed is None:  # the first call: every flow (those forgotten before were never read)
            self._changed = set()
            return dict(self.own)
        out = {f: self.own.get(f, 0.0) for f in self._changed}
        self._changed.clear()
        return out


class FlowQueue(Generic[T]):
    def __init__(
        self,
        size: int,
        fairness: Fairness,
        weight: Callable[[str], float] | None = None,
        accounts: FlowAccounts | None = None,
        max_flows: int = DEFAULT_MAX_FLOWS,
    ) -> None:
        """``max_flows``: the flows whose accounts are kept when ``accounts`` is None (``LocalAccounts``)."""
        self.size = size
        self.fairness = fairness
        self.weight = weight or (lambda tenant: 1.0)
        self._queues: dict[Flow, deque[Waiter[T]]] = {}
        self._n = 0
        self.accounts: FlowAccounts = accounts or LocalAccounts(max_flows)

    def __len__(self) -> int:
        return self._n

    def depth(self, flow: Flow) -> int:
        q = self._queues.get(flow)
        return len(q) if q else 0

    def waiting(self, flow: Flow) -> int:
        """Waiters of ``flow`` here and, with the host's accounts, in every worker of the host."""
        return self.accounts.waiting(flow, self.depth(flow))

    def flows(self) -> list[Flow]:
        """Flows with waiters."""
        return [f for f, q in self._queues.items() if q]

    def counter(self, flow: Flow) -> float:
        return self.accounts.counter(flow)

    def _floor(self, flow: Flow) -> float:
        """What ``flow``'s counter is lifted to when it becomes backlogged."""
        return self.accounts.lift(flow, {f: len(q) for f, q in self._queues.items()})

    def rank(self, w: Waiter[T]) -> tuple[int, float, int]:
        """Smaller is served first."""
        return self.rank_of(w.flow, w.ticket)

    def rank_of(self, flow: Flow, ticket: int) -> tuple[int, float, int]:
        if self.fairness == "fifo":
            return (0, 0.0, ticket)
        return (-flow.priority, self.counter(flow), ticket)

    def heads(self) -> list[Waiter[T]]:
        """Every flow's longest waiter, in the order they would be served."""
        return sorted((q[0] for q in self._queues.values() if q), key=self.rank)

    def best(self) -> Waiter[T] | None:
        hs = [q[0] for q in self._queues.values() if q]
        return min(hs, key=self.rank) if hs else None

    def push(self, w: Waiter[T], waiting: int | None = None) -> Waiter[T] | None:
        """Let ``w`` wait.  Returns the waiter it displaced (to be refused: 429), or None; ``Refused`` when
        ``w`` may not wait.  ``waiting``: how many wait where ``size`` bounds them (the host's queue, when
        several processes share it; only this queue's own waiters can be displaced)."""
        if self.fairness != "fifo" and w.flow.priority < 0:
            raise Refused("sheddable")
        q = self._queues.get(w.flow)
        lifted = self.counter(w.flow) if q else self._floor(w.flow)
        victim = None
        if (self._n if waiting is None else waiting) >= self.size:
            victim = self._victim(w.flow, lifted)
            if victim is None:
                raise Refused("queue_full")
            self.remove(victim)
            q = self._queues.get(w.flow)
        if not q:
            self.accounts.set_counter(w.flow, lifted)
            q = self._queues[w.flow] = deque()
        q.append(w)
        self._n += 1
        self.accounts.set_waiting(w.flow, len(q))
        return victim

    def _victim(self, flow: Flow, counter: float) -> Waiter[T] | None:
        best: tuple[int, float, int, str] | None = None
        pick: Flow | None = None
        for f, q in self._queues.items():
            if not q or f == flow:
                continue
            outranked = f.priority < flow.priority or (
                self.fairness != "fifo" and f.priority == flow.priority and self.counter(f) > counter
            )
            if self.fairness == "fifo" or not outranked:
                continue
            key = (f.priority, -self.counter(f), -len(q), f.tenant)
            if best is None or key < best:
                best, pick = key, f
        return None if pick is None else self._queues[pick][-1]

    def remove(self, w: Waiter[T]) -> bool:
        """``w`` leaves the queue (admitted, timed out, gone); False if it was not waiting."""
        q = self._queues.get(w.flow)
        if not q:
            return False
        try:
            q.remove(w)
        except ValueError:
            return False
        self._n -= 1
        self.accounts.set_waiting(w.flow, len(q))
        if not q:
            del self._queues[w.flow]
        return True

    def charge(self, flow: Flow, cost: float) -> None:
        """``flow`` was given ``cost`` of service (negative: a correction once the true cost is known)."""
        self.accounts.charge(flow, cost / self.weight(flow.tenant))
