"""``RedisBlockIndex``: the block index in Redis, for standalone indexers that ingest and routers that read.

::

    kvrouter indexer ──Indexer(index=RedisBlockIndex)──▶ STORE / REMOVE / RETIRE (+ GC)  ─┐ one Lua
    (ingests events)                                                                      ├─ script
    stateless router ──Indexer(index=RedisBlockIndex)──▶ MATCH (longest prefix)  ─────────┘ per call

The same ``IndexBackend`` contract as the in-process ``BlockIndex`` (one behaviour suite runs against
both); the key layout and the scripts are in ``indexer.redis_lua``.  Every call is one round trip and one
atomic script; a lookup walks the prompt's chain hashes server-side, stopping at the first block no
source still matching holds, and returns per-source depths and tier splits.

Memory policy (bounded, with expiry):

* a hard cap per (source, medium): ``max_blocks_per_source`` (a store beyond it raises
  ``SourceOverCapacity``, as in process), so memory is at most sources x cap x the bytes per pair that
  ``kvrouter bench redis`` measures (docs/measurements.md, "Redis backend");
* every key carries a TTL (``key_ttl_s``, default 24 h), refreshed whenever a write touches it and, for
  the blocks a lookup matched, by every ``refresh_every``-th lookup (a refresh doubles a lookup's cost,
  and a block matched that often is hot enough to be caught by one).  Keys of an indexer that died, or
  of a namespace nobody uses, disappear by themselves.  A block cached longer than the TTL without
  being stored again or matched falls out of the index: a false miss, never a false hit; a later removal
  of it is counted as unknown.  Per-source counts are exact while nothing expires, approximate after;
* clearing or dropping a source takes O(1) (it moves to a fresh slot id); its old entries are deleted in
  chunks of ``gc_chunk`` by separate short scripts, so no script blocks Redis for long.

Speculative entries carry their expiry on a clock shared by every process: the caller's ``now`` plus
``clock_offset()`` (default: wall clock minus monotonic clock, so callers keep passing monotonic time).
``expire(now)`` costs nothing (a lookup compares expiries itself); expired entries are deleted by the next
``add_speculative`` or ``speculative_entries``.

The client must not decode responses (keys and values are binary).  Calls block for one round trip:
in an asyncio program, one Redis call per lookup (~0.2-0.4 ms for 512 blocks) sits in the event loop.
Routers call ``Indexer.lookup_chains`` (one round trip); ``Indexer.lookup(token_ids)`` adds one ``EXISTS``
per hashing chunk (``held_by_any``).  Ingest costs two round trips per ``BlockStored`` (parent, store).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import numpy as np
import redis

from . import redis_lua as lua
from .backend import IndexBackend
from .errors import SourceOverCapacity
from .hashing import I64Array
from .index import SourceMatch
from .types import ChainHash, Medium, SourceKey, Trust

_Arg = bytes | str | int | float
_NEVER = -1e300  # before any expire(now): every speculative entry counts, as in process


def _wall_minus_monotonic() -> float:
    return time.time() - time.monotonic()


def _blob(a: I64Array) -> bytes:
    return np.ascontiguousarray(a, dtype="<i8").tobytes()


def _enc(source: SourceKey) -> bytes:
    return f"{source.instance}\x00{source.dp_rank}".encode()


def _dec(raw: bytes) -> SourceKey:
    inst, _, rank = raw.decode().rpartition("\x00")
    return SourceKey(inst, int(rank))


class RedisBlockIndex:
    """The ``IndexBackend`` contract over one Redis namespace.  Writers: one per source (as in process)."""

    def __init__(
        self,
        client: redis.Redis,
        *,
        namespace: str = "kvidx",
        max_blocks_per_source: int = 8_000_000,
        key_ttl_s: float = 86_400.0,
        refresh_every: int = 64,
        gc_chunk: int = 2_000,
        clock_offset: Callable[[], float] = _wall_minus_monotonic,
    ) -> None:
        if "{" in namespace or "}" in namespace:
            raise ValueError("namespace must not contain braces (it becomes the keys' hash tag)")
        self.client = client
        self.prefix = f"{{{namespace}}}".encode()
        self.max_blocks_per_source = max_blocks_per_source
        self.key_ttl_ms = int(key_ttl_s * 1000)
        self.refresh_every = refresh_every
        self._lookups = 0
        self.gc_chunk = gc_chunk
        self.clock_offset = clock_offset
        self._now = _NEVER  # the latest expire(now), on the shared clock
        reg = client.register_script
        self._store, self._remove, self._retire, self._gc = (
            reg(lua.STORE),
            reg(lua.REMOVE),
            reg(lua.RETIRE),
            reg(lua.GC),
        )
        self._add_spec, self._spec_entries = reg(lua.ADD_SPECULATIVE), reg(lua.SPECULATIVE_ENTRIES)
        self._match, self._engine_chain, self._counts = reg(lua.MATCH), reg(lua.ENGINE_CHAIN), reg(lua.COUNTS)

    @classmethod
    def from_url(cls, url: str, **kw: object) -> RedisBlockIndex:
        return cls(redis.Redis.from_url(url, decode_responses=False), **kw)  # type: ignore[arg-type]

    def _shared(self, now: float) -> float:
        return now + self.clock_offset()

    # ------------------------------------------------------------------ writes
    def store(self, source: SourceKey, engine_hashes: I64Array, chains: I64Array, medium: Medium) -> None:
        if len(chains) == 0:
            return
        args: list[_Arg] = [
            self.prefix,
            _enc(source),
            int(medium),
            self.max_blocks_per_source,
            self.key_ttl_ms,
        ]
        if self._store(args=[*args, _blob(engine_hashes), _blob(chains)]) == -1:
            raise SourceOverCapacity(
                f"{source.label()} would hold more than {self.max_blocks_per_source} blocks"
            )

    def remove(self, source: SourceKey, engine_hashes: I64Array, medium: Medium) -> int:
        if len(engine_hashes) == 0:
            return 0
        return int(self._remove(args=[self.prefix, _enc(source), int(medium), _blob(engine_hashes)]))

    def clear_source(self, source: SourceKey) -> None:
        if self._retire(args=[self.prefix, _enc(source), 1]):
            self.collect()

    def drop_source(self, source: SourceKey) -> None:
        if self._retire(args=[self.prefix, _enc(source), 0]):
            self.collect()

    def collect(self) -> None:
        """Delete retired slots' entries, ``gc_chunk`` per script call, until none is left."""
        while int(self._gc(args=[self.prefix, self.gc_chunk])):
            pass

    def add_speculative(self, source: SourceKey, chains: I64Array, *, now: float, ttl: float) -> None:
        if len(chains) == 0:
            return
        self.expire(now)
        expiry = self._shared(now + ttl)
        args: list[_Arg] = [
            self.prefix,
            _enc(source),
            repr(expiry),
            repr(self._now),
            self.key_ttl_ms,
            _blob(chains),
        ]
        self._add_spec(args=args)

    def expire(self, now: float) -> None:
        self._now = max(self._now, self._shared(now))

    # ------------------------------------------------------------------ reads
    def _keys(self, chains: I64Array) -> bytes:
        """The blocks' keys back to back, fixed width (the script slices instead of concatenating)."""
        head = self.prefix + b":b:"
        out = np.empty((len(chains), len(head) + 8), dtype=np.uint8)
        out[:, : len(head)] = np.frombuffer(head, dtype=np.uint8)
        out[:, len(head) :] = np.ascontiguousarray(chains, dtype="<i8").view(np.uint8).reshape(-1, 8)
        return out.tobytes()

    def match(self, chains: I64Array) -> list[SourceMatch]:
        if len(chains) == 0:
            return []
        self._lookups += 1
        refresh = self.key_ttl_ms if self.refresh_every and self._lookups % self.refresh_every == 0 else 0
        flat = self._match(args=[self.prefix, repr(self._now), refresh, self._keys(chains)])
        return [
            SourceMatch(_dec(flat[i]), *(int(v) for v in flat[i + 1 : i + 6])) for i in range(0, len(flat), 6)
        ]

    def held_by_any(self, chain_hash: int) -> bool:
        key = self.prefix + b":b:" + int(chain_hash).to_bytes(8, "little", signed=True)
        return bool(self.client.exists(key))

    def engine_chain(self, source: SourceKey, engine_hash: int) -> ChainHash | None:
        e = int(engine_hash).to_bytes(8, "little", signed=True)
        raw = self._engine_chain(args=[self.prefix, _enc(source), e])
        return None if raw is None else ChainHash(int.from_bytes(raw, "little", signed=True))

    def sources(self) -> list[SourceKey]:
        raw: list[bytes] = self.client.hvals(self.prefix + b":src")  # type: ignore[assignment]
        return [_dec(v) for v in raw]

    def blocks(self, source: SourceKey) -> dict[Medium, int]:
        counts = self._counts(args=[self.prefix, _enc(source)])
        return {m: int(counts[m]) for m in Medium}

    def total_entries(self) -> int:
        return sum(int(v) for v in self._counts(args=[self.prefix, b""]))

    def speculative_entries(self) -> int:
        return int(self._spec_entries(args=[self.prefix, repr(self._now)]))

    # ------------------------------------------------------------------ trust (outside the index seam)
    def publish_trust(self, trust: Mapping[SourceKey, Trust], *, ttl_s: float) -> None:
        """The ingesting side: every source's trust, replaced atomically, gone after ``ttl_s`` unless
        published again, so readers stop trusting the index of an indexer that died."""
        key = self.prefix + b":trust"
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(key)
        if trust:
            pipe.hset(key, mapping={_enc(s): t.value for s, t in trust.items()})
            pipe.pexpire(key, int(ttl_s * 1000))
        pipe.execute()

    def read_trust(self) -> dict[SourceKey, Trust]:
        """The reading side (stateless routers): the trust the ingesting indexer last published."""
        raw: dict[bytes, bytes] = self.client.hgetall(self.prefix + b":trust")  # type: ignore[assignment]
        return {_dec(k): Trust(v.decode()) for k, v in raw.items()}


def _satisfies(i: RedisBlockIndex) -> IndexBackend:
    return i  # mypy checks the Protocol here
