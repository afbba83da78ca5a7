"""Placement claims: the first router replica to place a prompt no target holds claims the placement in
Redis; a replica placing the same prompt while the claim lives follows it.

::

    pipeline: new prefix (no target holds its first block) ─▶ decide: target T
              ─▶ PrefixClaims.claim(first block's chain, T) ─▶ one Lua call: the claim's target, T if none
              ─▶ owner ≠ T: T's slot given back, the owner expected to hold the prompt (a speculative
                 entry there, in this index alone) ─▶ decide again
    P:claim:<chain>   string  target key    PX ttl      (P = ``{namespace}:replicas``, as the sync keys)

A claim is one atomic step, living as long as a speculative entry.  A failure (Redis down or slower than
``replicas.timeout_s``) is counted and the request is placed on the local view; for ``replicas.lease_s``
after one, new prompts are placed without asking (``skipped``).  A claim only ever narrows where a new
prompt goes; no request needs one.  Why claims: docs/replicas.md.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import redis
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from .config import SharedStateConfig

_CLAIM = """
local v = redis.call('GET', KEYS[1])
if v then return v end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return ARGV[1]
"""

OUTCOMES = ("won", "followed", "error", "skipped")


class PrefixClaims:
    """One process's claims (each worker of a host has its own connection: no leader on this path)."""

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
        self.prefix = f"{{{config.namespace}}}:replicas:claim:".encode()
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.timeout_s = config.timeout_s
        self.pause_s = config.lease_s
        self.clock = clock
        self._resume_at = 0.0
        """After a failure, no claim is asked for before this (``clock``)."""
        self._script = client.register_script(_CLAIM)
        self.outcomes = Counter(
            "kvrouter_shared_state_prefix_claims",
            "Placements of a prompt no target held: the claim names the target this router chose (won: "
            "its own claim, or one that agrees), another target (followed), or none (error: the claim "
            "failed; skipped: not asked, a recent one failed)",
            ["outcome"],
            registry=registry,
        )

    async def claim(self, chain: int, target: str) -> str | None:
        """The target the prompt whose first block is ``chain`` goes to: ``target`` if this call claimed
        it, another replica's claim if one lives, None if Redis did not answer in time (or failed lately)."""
        if self.clock() < self._resume_at:
            self.outcomes.labels("skipped").inc()
            return None
        key = self.prefix + str(chain).encode()
        try:
            async with asyncio.timeout(self.timeout_s):
                got = await self._script(keys=[key], args=[target, self.ttl_ms])
        except (redis.RedisError, OSError, TimeoutError):
            self.outcomes.labels("error").inc()
            self._resume_at = self.clock() + self.pause_s
            return None
        owner = got.decode() if isinstance(got, bytes) else str(got)
        self.outcomes.labels("won" if owner == target else "followed").inc()
        return owner

    async def close(self) -> None:
        await self.client.aclose()
