"""Where replicas meet: a ``ReplicaStore`` answers one ``SyncRequest`` with the peers' state, atomically.

Two implementations pass one behaviour suite (``tests/kvrouter/replicas/test_store_contract.py``):
``RedisReplicaStore`` (one Lua script per round trip, on a real Redis) and ``MemoryReplicaHub`` (the same
semantics in process, on a clock passed in: the virtual fleet's replicas meet there).

Redis keys (``P`` = ``{namespace}``; all expire by themselves):
- ``P:load:<replica>`` (msgpack LoadReport, PX lease), ``P:members`` (zset scored by lease end, stale
  members pruned per sync), ``P:spec`` (stream of ``{r: replica, b: msgpack list[SpecWire]}``, trimmed to
  the last ``window`` by MINID), ``P:queue:<replica>`` ("<ms>:" + msgpack QueueWire, PX lease; absent
  while it has no waiters);
- ``P:cum:<replica>`` (hash: each service total "s:..." as that replica last published it), ``P:cum``
  (hash: their sum over every replica; a replica's published total replaces its previous one, so a
  repeat is harmless), ``P:use:<replica>`` (hash: its rate use "r:..", "t:..", read for every live peer,
  empty or not).  Running totals are kept a day after their last round trip: a replica gone keeps its
  share of the service (service given).  A total published as 0 (the replica forgot the flow:
  ``flows.LocalAccounts``) is removed, and so is a sum that falls to 0 (every replica forgot it);
- ``P:cumv`` (a version, one more at each round trip that changes a sum), ``P:cumt`` (zset: each sum's
  name scored by the version that last changed it), ``P:cume`` (the epoch: the store's time when these
  began).  A reply's ``totals_at`` is "<epoch>:<version>"; a request since it gets only the sums changed
  after it, so a round trip costs what changed, not the number of tenants (a dropped sum: as 0).  Since
  another epoch, or a version the store has not reached (a restart, an expiry), or one before ``P:cuml``:
  every sum.  ``P:cumd`` (zset: the dropped sums' names by the version that dropped them): those older
  than ``keep_versions`` leave ``P:cumt`` and ``P:cuml`` moves up to them, so the log of changes holds
  the flows alive, not every flow ever seen.

One script per round trip: refresh our lease, prune dead members, append our batch, trim, then read
every other live member's load and the peers' batches after our cursor.  A replica that stops (crash,
partition) stops refreshing: its load vanishes when its lease ends and its entries when their TTL does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import redis.asyncio as aioredis

from .state import SyncReply, SyncRequest

KEEP_VERSIONS = 100_000
"""How long (in versions of the sums) the name of a dropped sum stays in the change log; a reader whose
last reply is older reads every sum."""

FORGOTTEN = 1e-6
"""A sum this close to 0 is dropped: every replica that gave the flow service has forgotten it (published
0: ``flows.LocalAccounts``).  A reader of changes gets it as 0."""


class ReplicaStore(Protocol):
    async def sync(self, req: SyncRequest) -> SyncReply:
        """Publish ``req`` and read the peers' state, as one atomic step."""
        ...

    async def leave(self, replica: str) -> None:
        """A graceful stop: drop this replica's lease now rather than when it expires."""
        ...


_SYNC = """
local P, me, lease, loads, spec, cursor = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5], ARGV[6]
local window, maxread, keep = tonumber(ARGV[7]), tonumber(ARGV[8]), __KEEP__
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
local queue, qk = ARGV[9] or '', P..':queue:'..me
if queue ~= '' then
  redis.call('SET', qk, string.format('%d', now)..':'..queue, 'PX', lease)
else
  redis.call('DEL', qk)
end
local ck, mine, use = P..':cum', P..':cum:'..me, P..':use:'..me
local vk, tk, ek, dk, lk = P..':cumv', P..':cumt', P..':cume', P..':cumd', P..':cuml'
local epoch = redis.call('GET', ek)
if not epoch then
  epoch = string.format('%d', now)
  redis.call('SET', ek, epoch)
  redis.call('DEL', vk, tk, dk, lk)
end
local version = false
for i = 11, #ARGV, 2 do
  if string.sub(ARGV[i], 1, 2) == 's:' then
    local old, new = tonumber(redis.call('HGET', mine, ARGV[i]) or '0'), tonumber(ARGV[i + 1])
    local sum = redis.call('HINCRBYFLOAT', ck, ARGV[i], string.format('%.17g', new - old))
    if new == 0 then redis.call('HDEL', mine, ARGV[i]) else redis.call('HSET', mine, ARGV[i], ARGV[i + 1]) end
    if not version then version = redis.call('INCR', vk) end
    redis.call('ZADD', tk, version, ARGV[i])
    if math.abs(tonumber(sum)) < 1e-6 then
      redis.call('HDEL', ck, ARGV[i])
      redis.call('ZADD', dk, version, ARGV[i])
    else
      redis.call('ZREM', dk, ARGV[i])
    end
  else
    redis.call('HSET', use, ARGV[i], ARGV[i + 1])
  end
end
local low = tonumber(redis.call('GET', lk) or '0')
if version and version - low >= 2 * keep then
  -- the names of sums dropped long ago leave the change log; a reader from before them reads every sum
  low = version - keep
  local gone = redis.call('ZRANGEBYSCORE', dk, '-inf', low)
  for j = 1, #gone, 1000 do
    redis.call('ZREM', tk, unpack(gone, j, math.min(j + 999, #gone)))
  end
  redis.call('ZREMRANGEBYSCORE', dk, '-inf', low)
  redis.call('SET', lk, low)
end
for _, k in ipairs({ck, mine, use, vk, tk, ek, dk, lk}) do redis.call('PEXPIRE', k, 86400000) end
local peers, queues, uses = {}, {}, {}
for _, r in ipairs(redis.call('ZRANGE', mk, 0, -1)) do
  if r ~= me then
    local v = redis.call('GET', P..':load:'..r)
    if v then peers[#peers + 1] = v end
    local q = redis.call('GET', P..':queue:'..r)
    if q then queues[#queues + 1] = q end
    uses[#uses + 1] = r
    uses[#uses + 1] = redis.call('HGETALL', P..':use:'..r)
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
local cur = tonumber(redis.call('GET', vk) or '0')
local e, v = string.match(ARGV[10], '^(%d+):(%d+)$')
local totals, full = {}, 1
if e == epoch and tonumber(v) <= cur and tonumber(v) >= low then
  full = 0
  local names = redis.call('ZRANGEBYSCORE', tk, '('..v, '+inf')
  for j = 1, #names, 1000 do
    local part = {}
    for k = j, math.min(j + 999, #names) do part[#part + 1] = names[k] end
    local vals = redis.call('HMGET', ck, unpack(part))
    for k = 1, #part do
      totals[#totals + 1] = part[k]
      totals[#totals + 1] = vals[k] or '0'
    end
  end
else
  totals = redis.call('HGETALL', ck)
end
return {now, last, peers, specs, queues, totals, uses, epoch..':'..cur, full}
"""


def _stream_ms(entry_id: bytes | str) -> int:
    s = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(s.partition("-")[0])


class RedisReplicaStore:
    """The store on Redis.  Errors propagate (``redis.RedisError``, ``OSError``): the shell counts them."""

    def __init__(
        self, client: aioredis.Redis, namespace: str = "kvrouter", *, keep_versions: int = KEEP_VERSIONS
    ) -> None:
        self.client = client
        self.prefix = f"{{{namespace}}}:replicas".encode()
        self._script = client.register_script(_SYNC.replace("__KEEP__", str(int(keep_versions))))

    async def sync(self, req: SyncRequest) -> SyncReply:
        args: list[bytes | str | int | float] = [self.prefix, req.replica, req.lease_ms, req.loads, req.specs]
        args += [req.cursor, req.window_ms, req.max_read, req.queue, req.totals_since]
        for name, value in req.counts:
            args += [name, repr(float(value))]
        now, last, peers, specs, queues, totals, uses, at, full = await self._script(args=args)
        pairs = [(_stream_ms(specs[i]), bytes(specs[i + 1])) for i in range(0, len(specs), 2)]
        cursor = last.decode() if isinstance(last, bytes) else str(last)
        return SyncReply(
            int(now),
            cursor,
            [bytes(p) for p in peers],
            pairs,
            [_stamped(bytes(q)) for q in queues],
            _floats(totals),
            {_text(uses[i]): _floats(uses[i + 1]) for i in range(0, len(uses), 2)},
            _text(at),
            bool(full),
        )

    async def leave(self, replica: str) -> None:
        await self.client.zrem(self.prefix + b":members", replica)
        r = replica.encode()
        await self.client.delete(self.prefix + b":load:" + r, self.prefix + b":queue:" + r)


def _stamped(raw: bytes) -> tuple[int, bytes]:
    ms, _, blob = raw.partition(b":")
    return int(ms), blob


def _text(b: bytes | str) -> str:
    return b.decode() if isinstance(b, bytes) else b


def _floats(flat: list[bytes]) -> dict[str, float]:
    return {_text(flat[i]): float(flat[i + 1]) for i in range(0, len(flat), 2)}


class _Member:
    __slots__ = ("lease_end", "loads", "queue")

    def __init__(self, loads: bytes, lease_end: int, queue: tuple[int, bytes] | None) -> None:
        self.loads, self.lease_end, self.queue = loads, lease_end, queue


class MemoryReplicaHub:
    """The same semantics in process, on ``clock()`` (seconds).  One hub serves every replica."""

    def __init__(self, clock: Callable[[], float], *, keep_versions: int = KEEP_VERSIONS) -> None:
        self.clock = clock
        self.keep_versions = keep_versions
        self.members: dict[str, _Member] = {}
        self.stream: list[tuple[int, int, str, bytes]] = []  # (ms, seq, replica, blob), ids increasing
        self._last_id = (0, 0)
        self.totals: dict[str, float] = {}
        self.published: dict[str, dict[str, float]] = {}
        """Each replica's service totals as it last published them (kept after it leaves)."""
        self.use: dict[str, dict[str, float]] = {}
        """Each replica's rate use as it last published it."""
        self.epoch = str(int(clock() * 1000))
        self.version = 0
        self.changed: dict[str, int] = {}
        """Each total's name and the version that last changed it (Redis: ``P:cumt``)."""
        self.dropped: dict[str, int] = {}
        """Names of the sums dropped, by the version that dropped them (Redis: ``P:cumd``)."""
        self.low = 0
        """The oldest version a reader of changes may come from (Redis: ``P:cuml``)."""

    def sync_now(self, req: SyncRequest) -> SyncReply:
        now = int(self.clock() * 1000)
        queue = (now, req.queue) if req.queue else None
        self.members[req.replica] = _Member(req.loads, now + req.lease_ms, queue)
        mine = self.published.setdefault(req.replica, {})
        use = self.use.setdefault(req.replica, {})
        bumped = False
        for name, value in req.counts:
            if name.startswith("s:"):
                total = self.totals.get(name, 0.0) + value - mine.pop(name, 0.0)
                if value:
                    mine[name] = value
                if not bumped:
                    self.version, bumped = self.version + 1, True
                self.changed[name] = self.version
                if abs(total) < FORGOTTEN:
                    self.totals.pop(name, None)
                    self.dropped[name] = self.version
                else:
                    self.totals[name] = total
                    self.dropped.pop(name, None)
            else:
                use[name] = value
        if bumped and self.version - self.low >= 2 * self.keep_versions:
            self.low = self.version - self.keep_versions
            for name in [n for n, v in self.dropped.items() if v <= self.low]:
                del self.dropped[name], self.changed[name]
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
        queues = [m.queue for r, m in self.members.items() if r != req.replica and m.queue is not None]
        specs = [(e[0], e[3]) for e in news if e[2] != req.replica]
        uses = {r: dict(self.use.get(r, {})) for r in self.members if r != req.replica}
        epoch, _, since = req.totals_since.partition(":")
        full = epoch != self.epoch or not since.isdigit() or not self.low <= int(since) <= self.version
        totals = (
            dict(self.totals)
            if full
            else {k: self.totals.get(k, 0.0) for k, v in self.changed.items() if v > int(since)}
        )
        at = f"{self.epoch}:{self.version}"
        return SyncReply(now, cursor, peers, specs, queues, totals, uses, at, full)

    async def sync(self, req: SyncRequest) -> SyncReply:
        return self.sync_now(req)

    async def leave(self, replica: str) -> None:
        self.members.pop(replica, None)


def _satisfies(r: RedisReplicaStore, m: MemoryReplicaHub) -> tuple[ReplicaStore, ReplicaStore]:
    return r, m  # mypy checks the Protocol here
