"""session: a request of a session goes where the session's last request went, while that target is a
candidate (healthy), under its concurrency threshold and within kv-aware's load bound; otherwise (and
without a session) kv-aware, which finds the session's history in the cache anyway (HyperPod's "session"
strategy).

The session table is the router's (``SessionTable``), filled on every dispatch whatever the policy, so
the session policy's shadow choice is real.
"""

from __future__ import annotations

from typing import ClassVar

from ...types import TargetKey
from ..expiring import ExpiringMap
from .base import Candidate, PolicyConfig, PolicyContext, RouteView, load_cap
from .kv_aware import KvAware

SESSION = "session"


class SessionSettings(PolicyConfig, frozen=True):
    name: ClassVar[str] = SESSION
    reads_index: ClassVar[bool] = True

    header: str = "x-session-id"
    """The request header naming a request's session (also read: the body's ``session_id``, as vLLM)."""
    ttl_s: float = 1800.0
    """A session not seen for this long is forgotten (its next request is routed kv-aware)."""
    max_sessions: int = 100_000
    """Sessions remembered at most (those expiring first are forgotten first)."""

    def build(self, context: PolicyContext) -> SessionAffinity:
        return SessionAffinity(context.sessions, KvAware(context.settings.kv_aware))


class SessionTable:
    """Session -> the target its last request was sent to (bounded, sliding expiry)."""

    def __init__(self, settings: SessionSettings | None = None) -> None:
        self.settings = settings or SessionSettings()
        self.map: ExpiringMap[str, TargetKey] = ExpiringMap(self.settings.max_sessions)

    def pinned(self, session: str, now: float) -> TargetKey | None:
        return self.map.get(session, now)

    def record(self, session: str, target: TargetKey, now: float) -> None:
        self.map.put(session, target, now, self.settings.ttl_s)


class SessionAffinity:
    name = SESSION

    def __init__(self, table: SessionTable, kv: KvAware) -> None:
        self.table = table
        self.kv = kv

    def rank(self, req: RouteView, cands: list[Candidate], *, dry_run: bool = False) -> list[Candidate]:
        ranked = self.kv.rank(req, cands, dry_run=dry_run)
        if req.session is None or req.now is None:
            return ranked
        pin = self.table.pinned(req.session, req.now)
        c = next((c for c in ranked if c.target == pin), None) if pin is not None else None
        if c is None or c.saturated or self._over_bound(c, cands):
            return ranked
        ranked.remove(c)
        c.score = -1.0  # below any kv-aware cost: marks the session's own choice
        return [c, *ranked]

    def reason(self, chosen: Candidate) -> str:
        if chosen.score < 0:
            return "session"
        return self.kv.reason(chosen)

    def _over_bound(self, c: Candidate, cands: list[Candidate]) -> bool:
        s = self.kv.settings
        cap = load_cap(cands, s.load_bound, s.load_slack)
        return cap is not None and c.load > cap
