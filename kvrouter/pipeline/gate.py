"""A bounded wait for capacity: requests that find every instance at their cap wait here for at most
``timeout``, as flows (``kvrouter.flows.FlowQueue``): the highest priority first, then the flow with the
least service; when ``size`` already wait, the newcomer displaces a waiter it outranks or is turned away
(429 + Retry-After), as is one expected to wait past ``timeout`` (``queue_wait``, ``early_refusal``).

Capacity freed (``release``) is handed out here, not raced for: ``pump`` tries the head ranked first; a
head that finds no capacity makes its group (its model) wait, and the next group's head is tried.  A
newcomer goes straight to ``attempt`` only when no request of its group waits, so a late arrival never
overtakes one that waits.  Every admitted request is charged to its flow when it gets capacity.

With several worker processes, ``shared`` makes the queue the host's: ``size`` bounds every worker's
waiters together, and a worker's best waiter takes freed capacity only when no other worker's best
waiter outranks it; other router replicas' waiters (``kvrouter.replicas.flows``) count and rank too.
Capacity freed in another worker cannot wake this loop: a worker with waiters looks again every
``shared.poll_s``; alone, the best waiter looks again every ``recheck_s`` (capacity can come back without
a release: an instance back in rotation, an ejection over)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable
from typing import Any, Generic, Protocol, TypeVar

from ..flows import DEFAULT_MAX_FLOWS, BucketStore, Fairness, Flow, FlowAccounts, FlowQueue, Refused, Waiter
from .queue_wait import WaitEstimate

T = TypeVar("T")

DEFAULT_FLOW = Flow("default", 0)


class QueueFull(Exception):
    """``queue_full``, ``queue_timeout``, ``expected_timeout`` (it would wait past the timeout),
    ``sheddable`` (a flow below priority 0 finds no capacity), ``displaced`` (a waiter pushed out by one
    that outranks it) or ``shutting_down`` (this router stops: its waiters are answered, not dropped)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class SharedFlows(FlowAccounts, BucketStore, Protocol):
    """The flows' accounts and rate buckets in the host's memory (``kvrouter.host.HostFlows``)."""


class SharedQueue(Protocol):
    """The host's queue rows (``kvrouter.host.QueueBoard``), and its flows' accounts and rate buckets."""

    @property
    def flows(self) -> SharedFlows: ...

    @property
    def poll_s(self) -> float:
        """How often a waiter looks again for capacity freed where it cannot be woken."""

    def waiting_total(self) -> int:
        """Waiters in every worker of this host."""

    def peers_waiting(self) -> int:
        """Waiters in other router replicas (``kvrouter.replicas.flows``; 0 without them)."""

    def set_waiting(self, n: int, head: tuple[Flow, int, str] | None) -> None:
        """This worker's waiters, and its best one's flow, ticket and group (``str(group)``)."""

    def set_groups(self, groups: list[str]) -> None:
        """The groups this worker's flows' heads wait in (``str(group)``)."""

    def other_groups(self) -> set[str] | None:
        """The groups other workers' waiters wait in (None: not known for some)."""

    def heads(self) -> list[tuple[Flow, int]]:
        """Every other worker's best waiter (flow, ticket)."""

    def peer_tops(self) -> list[tuple[str, int]]:
        """Other router replicas' best waiters: (group, priority)."""


class _Pending(Generic[T]):
    __slots__ = ("attempt", "cost", "fut")

    def __init__(self, fut: asyncio.Future[T], attempt: Callable[[], T | None], cost: Callable[[T], float]):
        self.fut = fut
        self.attempt = attempt
        self.cost = cost


def _free(_: Any) -> float:
    return 0.0


class CapacityGate:
    def __init__(
        self,
        size: int,
        timeout_s: float,
        *,
        fairness: Fairness = "fifo",
        weight: Callable[[str], float] | None = None,
        shared: SharedQueue | None = None,
        recheck_s: float = 0.05,
        on_depth: Callable[[int], None] | None = None,
        on_flow_depth: Callable[[Flow, int], None] | None = None,
        early_refusal: bool = True,
        max_flows: int = DEFAULT_MAX_FLOWS,
    ) -> None:
        self.on_depth = on_depth
        """Told the number waiting whenever a request begins or ends waiting (a gauge)."""
        self.on_flow_depth = on_flow_depth
        """Told a flow's number waiting whenever it changes."""
        self.timeout_s = timeout_s
        self.shared = shared
        self.poll_s = recheck_s if shared is None else shared.poll_s
        self.recheck_s = recheck_s
        # With a shared queue the flows' accounts are the host's: one scheduler over every worker.
        self.queue: FlowQueue[_Pending[Any]] = FlowQueue(
            size, fairness, weight, accounts=None if shared is None else shared.flows, max_flows=max_flows
        )
        self.early_refusal = early_refusal
        self.wait = WaitEstimate()
        """Seconds a place in the queue costs, from the waits that ended here."""
        self.closed = False
        """Set by ``close``: nothing waits any more."""

    @property
    def size(self) -> int:
        return self.queue.size

    @property
    def waiting(self) -> int:
        """Requests waiting (in every worker of the host when the queue is shared; not other replicas')."""
        return self.shared.waiting_total() if self.shared is not None else len(self.queue)

    def _everywhere(self) -> int:
        """Requests waiting wherever ``size`` bounds them: this host and the other replicas."""
        if self.shared is None:
            return len(self.queue)
        return self.shared.waiting_total() + self.shared.peers_waiting()

    def close(self) -> int:
        """This router stops: every waiter is refused now (``shutting_down``, 429 with Retry-After: another
        replica can take it) rather than left to be cut off.  Returns how many."""
        self.closed = True
        refused = 0
        while (w := self.queue.best()) is not None:
            self.queue.remove(w)
            if not w.item.fut.done():
                w.item.fut.set_exception(QueueFull("shutting_down"))
                refused += 1
            self._publish(w.flow)
        return refused

    def _publish(self, flow: Flow) -> None:
        if self.shared is not None:
            best = self.queue.best()
            head = None if best is None else (best.flow, best.ticket, str(best.group))
            self.shared.set_groups(sorted({str(h.group) for h in self.queue.heads()}))
            self.shared.set_waiting(len(self.queue), head)
        if self.on_depth is not None:
            self.on_depth(self.waiting)
        if self.on_flow_depth is not None:
            self.on_flow_depth(flow, self.queue.depth(flow))

    def _group_waits(self, group: Hashable) -> bool:
        if self.shared is not None:
            if self.shared.waiting_total() > len(self.queue):
                # another worker's waiters: a newcomer of a group their heads wait in waits behind them
                # (as it would in one process), of another group not (None: their groups not known)
                groups = self.shared.other_groups()
                if groups is None or str(group) in groups:
                    return True
            if any(g == str(group) for g, _ in self.shared.peer_tops()):
                return True  # another replica's best waiter is of this group (another's never holds it up)
        return any(h.group == group for h in self.queue.heads())

    def _places(self, flow: Flow) -> int:
        """The place a newcomer of ``flow`` would enter at: the waiters ranked ahead of it, plus itself.
        Other workers' waiters (ranks unknown here) count as if ranked like this worker's."""
        q = self.queue
        n = len(q)
        if q.fairness == "fifo":
            ahead = n
        else:
            mine = (-flow.priority, q.counter(flow))
            ahead = sum(q.depth(f) for f in q.flows() if (-f.priority, q.counter(f)) <= mine)
        if self.shared is not None:
            others = self._everywhere() - n
            if others > 0:
                ahead += others if n == 0 else round(others * ahead / n)
        return ahead + 1

    def charge(self, flow: Flow, cost: float) -> None:
        """Service given to ``flow`` outside an admission (a correction once vLLM reports the true cost)."""
        self.queue.charge(flow, cost)

    async def acquire(
        self,
        attempt: Callable[[], T | None],
        flow: Flow = DEFAULT_FLOW,
        *,
        group: Hashable = None,
        cost: Callable[[T], float] = _free,
        undo: Callable[[T], None] | None = None,
    ) -> T:
        """What ``attempt()`` gets once it gets something: at once if no request of ``group`` waits and
        there is capacity, else when ``pump`` hands this request capacity.  ``cost(got)`` is charged to
        ``flow``; ``undo(got)`` gives back capacity handed to a request that left meanwhile."""
        if not self._group_waits(group):
            got = attempt()
            if got is not None:
                self.queue.charge(flow, cost(got))
                return got
        if self.closed:
            raise QueueFull("shutting_down")
        places = self._places(flow)
        if self.early_refusal:
            expected = self.wait.expected(places)
            if expected is not None and expected > self.timeout_s:
                raise QueueFull("expected_timeout")
        loop = asyncio.get_running_loop()
        pending: _Pending[T] = _Pending(loop.create_future(), attempt, cost)
        w = Waiter(pending, flow, time.monotonic_ns(), group)
        try:
            displaced = self.queue.push(w, None if self.shared is None else self._everywhere())
        except Refused as e:
            raise QueueFull(e.reason) from None
        if displaced is not None:
            displaced.item.fut.set_exception(QueueFull("displaced"))
            self._publish(displaced.flow)
        self._publish(flow)
        self.pump(1)  # capacity for this group, now that it waits in its place
        entered = loop.time()
        deadline = entered + self.timeout_s
        try:
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    self.wait.observe(self.timeout_s, places)
                    raise QueueFull("queue_timeout")
                wait = min(remaining, self.poll_s)
                try:
                    got = await asyncio.wait_for(asyncio.shield(pending.fut), wait)
                    self.wait.observe(loop.time() - entered, places)
                    return got
                except TimeoutError:
                    if loop.time() >= deadline:
                        self.wait.observe(self.timeout_s, places)
                        raise QueueFull("queue_timeout") from None
                    if self.queue.best() is w:
                        self.pump(1)
        except BaseException:
            fut = pending.fut
            if fut.done() and not fut.cancelled() and fut.exception() is None and undo is not None:
                undo(fut.result())  # handed capacity, but this request left first: give it back ...
                self.queue.remove(w)
                self.release()  # ... to the next
            raise
        finally:
            if self.queue.remove(w):
                self._publish(flow)

    def pump(self, limit: int | None = None) -> int:
        """Hand capacity to waiters, best-ranked first, until ``limit`` got some or every waiting group's
        head found none.  Returns how many got capacity."""
        failed: set[Hashable] = set()
        served = 0
        while limit is None or served < limit:
            heads = [h for h in self.queue.heads() if self._class(h) not in failed]
            if not heads:
                break
            w = heads[0]
            if self.shared is not None and not self._first(w):
                break  # another worker's waiter comes first
            p = w.item
            try:
                got = p.attempt()
            except Exception as e:  # the waiter's own failure (no healthy target...), raised where it waits
                self.queue.remove(w)
                p.fut.set_exception(e)
                self._publish(w.flow)
                continue
            if got is None:
                failed.add(self._class(w))
                continue
            self.queue.remove(w)
            self.queue.charge(w.flow, p.cost(got))
            p.fut.set_result(got)
            self._publish(w.flow)
            served += 1
        return served

    def _class(self, w: Waiter[_Pending[Any]]) -> Hashable:
        """What capacity ``w`` can use: its group's, within the limits its priority and its flow's
        backlog set (``routing.saturation``: one that cannot fill the reserve fails where one that can
        may not).  A head that finds none makes its class wait, not its whole group."""
        return (w.group, w.flow.priority, self.queue.waiting(w.flow) > 1)

    def _first(self, w: Waiter[_Pending[Any]]) -> bool:
        """No other worker's best waiter outranks ``w`` (ranked with the host's accounts), and no other
        replica's best waiter of its group has a higher priority.  Between replicas only priority defers:
        what a peer did is a round trip old, and capacity a replica leaves for a peer's waiter stays idle
        until the peer hears of it, so within a priority each replica serves its own waiters, ranked by
        counters that count the peers' service (docs/flows.md)."""
        assert self.shared is not None
        q = self.queue
        mine = q.rank(w)
        if any(q.rank_of(f, t) <= mine for f, t in self.shared.heads()):
            return False
        if q.fairness == "fifo":
            return True
        group, prio = str(w.group), w.flow.priority
        return not any(p > prio and g == group for g, p in self.shared.peer_tops())

    def release(self) -> None:
        """Capacity was freed: hand it to the best-ranked waiter that can use it."""
        if self.queue:
            self.pump(1)

    def wake(self) -> None:
        """What outranked this host's waiters may have changed (other replicas' waiters, their load):
        hand capacity to every waiter that can now take it."""
        if self.queue:
            self.pump()
