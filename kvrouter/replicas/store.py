"""Where replicas meet: a ``ReplicaStore`` answers one ``SyncRequest`` with the peers' state, atomically.

Two implementations pass one behaviour suite (``tests/kvrouter/replicas/test_store_contract.py``):
``RedisReplicaStore`` (one Lua script per round trip, on a real Redis) and ``MemoryReplicaHub`` (the same
semantics in process, on a clock passed in: the virtual fleet's replicas meet there).

Redis keys (``P`` = ``{namespace}``; all expire by themselves): ``P:load:<replica>`` (msgpack
LoadReport, PX lease), ``P:members`` (zset scored by lease end, stale members pruned per sync),
``P:spec`` (stream of ``{r: replica, b: msgpack list[SpecWire]}``, trimmed to the last ``window`` by MINID).

One script per round trip: refresh our lease, prune dead members, append our batch, trim, then read
every other live member's load and the peers' batches after our cursor.  A replica that stops (crash,
partition) stops refreshing: its load vanishes when its lease ends and its entries when their TTL does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import redis.asyncio as aioredis

from .state import SyncReply, SyncRequest


class ReplicaStore(Protocol):
    async def sync(self, req: SyncRequest) -> SyncReply:
        """Publish ``req`` and read the peers' state, as one atomic step."""
        ...

    async def leave(self, replica: str) -> None:
        """A graceful stop: drop this replica's lease now rather than when it expires."""
        ...


_SYNC = """
local P, me, lease, loads, spec, cursor = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5], ARGV[6]
local window, maxread = tonumber(ARGV[7]), tonumber(ARGV[8])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local mk, sk = P..':members', P..':spec'
redis.call('SET', P..':load:'..me, loads, 'PX', lease)
redis.call('ZADD', mk, now + lease, me)
redis.call('ZREMRANGEBYSCORE', mk, '-inf', now)
redis.call('PEXPIRE', mk, lease)
if spec ~= '' then redis.call('XADD', sk, '*', 'r', me, 'b', spec) end
if redis.call('EXISTS', sk) == 1 then
  redis.call('XTRIM', sk, 'MINID', '~', now - window)
  redis.call('PEXPIRE', sk, window + lease)
end
local peers = {}
for _, r in ipairs(redis.call('ZRANGE', mk, 0, -1)) do
  if r ~= me then
    local v = redis.call('GET', P..':load:'..r)
    if v then peers[#peers + 1] = v end
  end
end
local start = '('..cursor
if cursor == '' then start = tostring(now - window) end
local specs, last = {}, cursor
for _, e in ipairs(redis.call('XRANGE', sk, start, '+', 'COUNT', maxread)) do
  last = e[1]
  local f = e[2]
  if f[2] ~= me then
    specs[#specs + 1] = e[1]
    specs[#specs + 1] = f[4]
  end
end
return {now, last, peers, specs}
"""


def _stream_ms(entry_id: bytes | str) -> int:
    s = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(s.partition("-")[0])


class RedisReplicaStore:
    """The store on Redis.  Errors propagate (``redis.RedisError``, ``OSError``): the shell counts them."""

    def __init__(self, client: aioredis.Redis, namespace: str = "kvrouter") -> None:
        self.client = client
        self.prefix = f"{{{namespace}}}:replicas".encode()
        self._script = client.register_script(_SYNC)

    async def sync(self, req: SyncRequest) -> SyncReply:
        args: list[bytes | str | int] = [self.prefix, req.replica, req.lease_ms, req.loads, req.specs]
        now, last, peers, specs = await self._script(args=[*args, req.cursor, req.window_ms, req.max_read])
        pairs = [(_stream_ms(specs[i]), bytes(specs[i + 1])) for i in range(0, len(specs), 2)]
        cursor = last.decode() if isinstance(last, bytes) else str(last)
        return SyncReply(int(now), cursor, [bytes(p) for p in peers], pairs)

    async def leave(self, replica: str) -> None:
        await self.client.zrem(self.prefix + b":members", replica)
        await self.client.delete(self.prefix + b":load:" + replica.encode())


class _Member:
    __slots__ = ("lease_end", "loads")

    def __init__(self, loads: bytes, lease_end: int) -> None:
        self.loads, self.lease_end = loads, lease_end


class MemoryReplicaHub:
    """The same semantics in process, on ``clock()`` (seconds).  One hub serves every replica."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.members: dict[str, _Member] = {}
        self.stream: list[tuple[int, int, str, bytes]] = []  # (ms, seq, replica, blob), ids increasing
        self._last_id = (0, 0)

    def sync_now(self, req: SyncRequest) -> SyncReply:
        now = int(self.clock() * 1000)
        self.members[req.replica] = _Member(req.loads, now + req.lease_ms)
        self.members = {r: m for r, m in self.members.items() if m.lease_end > now}
        if req.specs:
            ms, seq = self._last_id
            self._last_id = (ms, seq + 1) if ms >= now else (now, 0)
            self.stream.append((*self._last_id, req.replica, req.specs))
        cut = now - req.window_ms
        if self.stream and self.stream[0][0] < cut:
            self.stream = [e for e in self.stream if e[0] >= cut]
        peers = [m.loads for r, m in self.members.items() if r != req.replica]
        if req.cursor:
            c_ms, _, c_seq = req.cursor.partition("-")
            after = (int(c_ms), int(c_seq or 0))
            news = [e for e in self.stream if (e[0], e[1]) > after]
        else:
            news = [e for e in self.stream if e[0] >= cut]
        news = news[: req.max_read]
        cursor = f"{news[-1][0]}-{news[-1][1]}" if news else req.cursor
        return SyncReply(now, cursor, peers, [(e[0], e[3]) for e in news if e[2] != req.replica])

    async def sync(self, req: SyncRequest) -> SyncReply:
        return self.sync_now(req)

    async def leave(self, replica: str) -> None:
        self.members.pop(replica, None)


def _satisfies(r: RedisReplicaStore, m: MemoryReplicaHub) -> tuple[ReplicaStore, ReplicaStore]:
    return r, m  # mypy checks the Protocol here
