"""Configuration of shared router state (one struct, documented per field, validated once)."""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Mapping

import msgspec

from indexer.errors import ConfigError

REDIS_URL_ENV = "KVROUTER_REDIS_URL"


class SharedStateConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    redis_url: str | None = None
    """Redis shared by the router replicas (``redis://host:6379/0``); None: one router, nothing shared."""
    namespace: str = "kvrouter"
    """Key prefix (the keys' hash tag): replicas of one fleet share it, other fleets use another."""
    replica_id: str | None = None
    """This replica's name in Redis; None: ``<hostname>-<pid>-<random>``, unique per process."""
    interval_s: float = 0.05
    """How often a replica publishes its state and reads the others' (one Redis round trip).  Peers learn
    of a request this much later on average, so a longer interval costs hit rate under bursts of new
    prefixes (docs/measurements.md, "replica sync interval")."""
    lease_s: float = 2.0
    """A replica's published load lives this long unless refreshed: a crashed replica's load is gone
    after at most this.  Also how long a Redis outage may last before the others' load is dropped."""
    speculative: bool = True
    """Share speculative entries (a burst of a new prefix sent through several replicas stays together)."""
    claim_new_prefixes: bool = True
    """Placing a prompt no target holds: claim the placement in Redis, or follow another replica's claim
    (``replicas.claims``), and publish it at once rather than at the next interval.  A claim is taken only
    by a replica told of every new prompt placed before it (those it had not heard of are expected where
    they went and the prompt decided again).  Under concurrent clients a new prompt's first requests reach
    several replicas before any round trip, which would otherwise place it apart, and distinct new prompts
    would pile onto the cache each replica sees least filled."""
    speculative_window_s: float = 10.0
    """How far back a (re)starting replica reads peers' speculative entries; entries older than this are
    trimmed from Redis (keep it above the indexer's speculative TTL)."""
    max_read: int = 2_000
    """Speculative batches read per round trip at most (the rest on the next one)."""
    max_unsent: int = 20_000
    """Speculative entries kept for publication while Redis is unreachable (oldest dropped first)."""
    timeout_s: float = 0.5
    """Connect and read timeout of one round trip."""

    def validate(self) -> None:
        if self.interval_s <= 0 or self.timeout_s <= 0:
            raise ConfigError("replicas: interval_s and timeout_s must be positive")
        if self.lease_s < 2 * self.interval_s:
            raise ConfigError("replicas: lease_s must be at least twice interval_s")
        if self.max_read <= 0 or self.max_unsent < 0:
            raise ConfigError("replicas: max_read must be positive and max_unsent >= 0")
        if "{" in self.namespace or "}" in self.namespace or not self.namespace:
            raise ConfigError("replicas: namespace must be non-empty and free of braces")
        if self.redis_url is not None and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(
                f"replicas: redis_url must be redis://, rediss:// or unix://, got {self.redis_url!r}"
            )

    def with_env(self, environ: Mapping[str, str] = os.environ) -> SharedStateConfig:
        """``KVROUTER_REDIS_URL`` overrides ``redis_url`` (the only environment variable read here)."""
        url = environ.get(REDIS_URL_ENV)
        return msgspec.structs.replace(self, redis_url=url) if url else self

    def resolved_replica_id(self) -> str:
        return self.replica_id or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class SnapshotConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    path: str | None = None
    """Snapshot file (replaced atomically); None with ``redis_key`` unset: no warm restart."""
    redis_key: str | None = None
    """Or a key in the replicas' Redis (``replicas.redis_url``), e.g. ``{kvrouter}:snapshot:<replica>``."""
    interval_s: float = 60.0
    """Snapshot period; one more is taken at shutdown.  Taking one stops the event loop briefly (~1 s per
    8M indexed pairs), so keep it coarse."""
    ttl_s: float | None = None
    """Expiry of the Redis key (a router gone that long starts cold); None: never."""

    @property
    def enabled(self) -> bool:
        return self.path is not None or self.redis_key is not None

    def validate(self) -> None:
        if self.path is not None and self.redis_key is not None:
            raise ConfigError("snapshot: set path or redis_key, not both")
        if self.interval_s <= 0:
            raise ConfigError("snapshot: interval_s must be positive")
