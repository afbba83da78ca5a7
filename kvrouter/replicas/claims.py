"""Placement claims: the first router replica to place a prompt no target holds claims the placement in
Redis; a replica placing the same prompt while the claim lives follows it; and new prompts are placed one
after another, each knowing where the ones before it went.

::

    new prefix ─▶ decide T ─▶ claim(chain, T, chains): one Lua call ─▶ the live claim's owner, else the
    placements logged since this process last asked (nothing claimed), else T claimed and logged
    owner ≠ T or newer placements ─▶ each expected where it went, decide again (the last ask just claims)
    P:claim:<chain> string target PX ttl;  P:placed stream {t, c} of the last ``lease_s``

A claim is one atomic step, living as long as a speculative entry.  A failure (Redis down or slower
than ``replicas.timeout_s``) is counted and the request is placed on the local view; for
``replicas.lease_s`` after one, new prompts are placed without asking (``skipped``).  The sequence step by
step, and why: docs/replicas.md.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from indexer.hashing import I64Array

from ..routing.new_placements import ClaimAnswer, NewPlacement, encode_chains
from ..types import TargetKey
from .config import SharedStateConfig

# KEYS: claim, placements log.  ARGV: target, ttl ms, since ('' none), window ms, look ('1'/'0'),
# chains, max placements returned.  Returns {owner} or {owner, id} (claimed: the log entry's id), or
# {'', entries} (placements since ``since``: nothing claimed).  Target keys are never empty.
_CLAIM = """
local v = redis.call('GET', KEYS[1])
if v then return {v} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window = tonumber(ARGV[4])
if ARGV[5] == '1' then
  local start = tostring(now - window)
  local ms = tonumber(string.match(ARGV[3], '^(%d+)'))
  if ms and ms >= now - window then start = '(' .. ARGV[3] end
  local got = redis.call('XRANGE', KEYS[2], start, '+', 'COUNT', tonumber(ARGV[7]))
  if #got > 0 then return {'', got} end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
local id = redis.call('XADD', KEYS[2], '*', 't', ARGV[1], 'c', ARGV[6])
redis.call('XTRIM', KEYS[2], 'MINID', '~', now - window)
redis.call('PEXPIRE', KEYS[2], 2 * window)
return {ARGV[1], id}
"""

OUTCOMES = ("won", "followed", "newer", "error", "skipped")

MAX_NEWER = 64
"""Placements returned by one claim at most (the rest by the next)."""


def _stream_id(raw: bytes) -> tuple[int, int]:
    ms, _, seq = raw.partition(b"-")
    return int(ms), int(seq or 0)


class PrefixClaims:
    """One process's claims (each worker of a host has its own connection and its own place in the log)."""

    tells_placements = True
    """Answers list the placements logged since this process last asked (``newer``)."""

    def __init__(
        self,
        config: SharedStateConfig,
        ttl_s: float,
        *,
        registry: CollectorRegistry | None = None,
        client: aioredis.Redis | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``ttl_s``: how long a claim lives (the indexer's speculative TTL)."""
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        if client is None:
            if config.redis_url is None:
                raise ValueError("PrefixClaims needs a client or config.redis_url")
            client = aioredis.Redis.from_url(
                config.redis_url,
                decode_responses=False,
                socket_timeout=config.timeout_s,
                socket_connect_timeout=config.timeout_s,
                retry=Retry(NoBackoff(), 0),
            )
        self.client = client
        base = f"{{{config.namespace}}}:replicas:"
        self.prefix = (base + "claim:").encode()
        self.log_key = (base + "placed").encode()
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.window_ms = max(1, int(config.lease_s * 1000))
        """Placements older than this are taken as known by the round trips (``SharedState``)."""
        self.timeout_s = config.timeout_s
        self.pause_s = config.lease_s
        self.clock = clock
        self._resume_at = 0.0
        """After a failure, no claim is asked for before this (``clock``)."""
        self._since = b""
        """The latest placement this process was told of or logged itself (a stream id)."""
        self._script = client.register_script(_CLAIM)
        self.outcomes = Counter(
            "kvrouter_shared_state_prefix_claims",
            "Placements of a prompt no target held: the claim names the target this router chose (won: "
            "its own claim, or one that agrees), another target (followed), or none (newer: other new "
            "prompts were placed since this router last asked, to weigh first; error: the claim failed; "
            "skipped: not asked, a recent one failed)",
            ["outcome"],
            registry=registry,
        )

    async def claim(
        self, chain: int, target: str, chains: I64Array, *, look: bool = True
    ) -> ClaimAnswer | None:
        """Where the prompt whose first block is ``chain`` (and whose blocks are ``chains``) goes:
        ``target`` if this call claimed it, another replica's claim if one lives; or, with ``look``, no
        owner and the new prompts placed since this process last asked, when there are any (nothing is
        claimed then).  None if Redis did not answer in time (or failed lately)."""
        if self.clock() < self._resume_at:
            self.outcomes.labels("skipped").inc()
            return None
        key = self.prefix + str(chain).encode()
        args: list[bytes | str | int] = [
            target,
            self.ttl_ms,
            self._since,
            self.window_ms,
            "1" if look else "0",
        ]
        args += [encode_chains(chains), MAX_NEWER]
        try:
            async with asyncio.timeout(self.timeout_s):
                got = await self._script(keys=[key, self.log_key], args=args)
        except (redis.RedisError, OSError, TimeoutError):
            self.outcomes.labels("error").inc()
            self._resume_at = self.clock() + self.pause_s
            return None
        owner = _text(got[0])
        if owner:
            if len(got) > 1:
                self._seen(got[1])
            self.outcomes.labels("won" if owner == target else "followed").inc()
            return ClaimAnswer(owner=TargetKey(owner))
        self.outcomes.labels("newer").inc()
        return ClaimAnswer(newer=self._placements(got[1]))

    def _placements(self, entries: Sequence[Any]) -> tuple[NewPlacement, ...]:
        out: list[NewPlacement] = []
        for raw_id, fields in entries:
            self._seen(raw_id)
            f = dict(zip(fields[::2], fields[1::2]))
            out.append(NewPlacement(TargetKey(_text(f[b"t"])), bytes(f[b"c"])))
        return tuple(out)

    def _seen(self, raw_id: bytes | str) -> None:
        rid = raw_id.encode() if isinstance(raw_id, str) else bytes(raw_id)
        if not self._since or _stream_id(rid) > _stream_id(self._since):
            self._since = rid

    async def close(self) -> None:
        await self.client.aclose()


def _text(v: bytes | str | int) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
