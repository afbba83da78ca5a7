"""The Lua scripts of ``RedisBlockIndex``: every update is one script, so it is atomic; a lookup is one.

Keys (``P`` is ``{namespace}``: one hash tag, so a Redis Cluster keeps them on one shard)::

    P:b:<chain>   string  one flags byte per slot: byte s (0-based) = slot s's tiers for this block,
                          bit 1 GPU, 2 CPU, 4 STORAGE, 8 speculative; trailing zero bytes trimmed
    P:slot        hash    source -> slot           P:src  hash  slot -> source (live slots only)
    P:next        string  slots handed out so far  P:free list  slots collected, to reuse
    P:dead        set     slots awaiting collection (cleared or dropped sources)
    P:e:<slot>    hash    engine hash (8 B) -> chain hash (8 B)
    P:x:<slot>    hash    chain (8 B) .. medium -> references beyond the first (duplicate stores)
    P:n:<slot>    hash    medium -> distinct chains held
    P:sp:<slot>   zset    chain (8 B) scored by its speculative expiry (shared clock, seconds)
    P:spnext      string  a lower bound of every speculative expiry (cleanup is skipped before it)

Why bytes per slot: a lookup reads one short string per block (``GET``) and, for each source still
matching, one ``string.byte``; per-field hashes cost several times more server CPU.  Slots are dense
(reused once collected) so the strings stay as short as the fleet.

Invariants: bit ``m`` of a live slot's byte is set iff the slot holds the chain in medium m (references
= 1 + its ``x`` entry), and ``n`` counts those bits; bit 8 is set iff the chain is in ``sp:<slot>``.
Clearing a source moves it to another slot in one step (readers see all of it or none of it); the old
slot's bytes are zeroed in bounded chunks (``GC``) before the slot is reused, so no script runs long.
"""

from __future__ import annotations

_PRELUDE = """
local BIT = {['0'] = 1, ['1'] = 2, ['2'] = 4}
local TIER = {}  -- flags -> best tier: 1 GPU, 2 CPU, 3 STORAGE, 4 speculative
for f = 1, 15 do
  if f % 2 == 1 then TIER[f] = 1 elseif f % 4 >= 2 then TIER[f] = 2 elseif f % 8 >= 4 then TIER[f] = 3
  else TIER[f] = 4 end
end
local function flags(v, slot)
  return (v and string.byte(v, slot + 1)) or 0
end
-- write slot's flags into the block's string (ttl: refresh it; nil: keep it); an all-zero string goes
local function put(key, v, slot, f, ttl)
  v = v or ''
  if #v <= slot then v = v .. string.rep('\\0', slot + 1 - #v) end
  v = string.gsub(string.sub(v, 1, slot) .. string.char(f) .. string.sub(v, slot + 2), '%z+$', '')
  if v == '' then
    redis.call('DEL', key)
  elseif ttl then
    redis.call('SET', key, v, 'PX', ttl)
  else
    redis.call('SET', key, v, 'KEEPTTL')
  end
end
local function slot_for(P, src)
  local slot = redis.call('HGET', P..':slot', src)
  if slot then return tonumber(slot) end
  slot = redis.call('LPOP', P..':free')
  if not slot then slot = redis.call('INCR', P..':next') - 1 end
  redis.call('HSET', P..':slot', src, slot)
  redis.call('HSET', P..':src', slot, src)
  return tonumber(slot)
end
local function touch(P, slot, ttl)
  for _, k in ipairs({P..':slot', P..':src', P..':next', P..':e:'..slot, P..':n:'..slot, P..':x:'..slot}) do
    redis.call('PEXPIRE', k, ttl)
  end
end
-- drop speculative entries whose expiry is <= now, unless none can be due yet
local function clean_spec(P, now, force)
  local due = redis.call('GET', P..':spnext')
  if not force and not (due and tonumber(due) <= now) then return end
  local low = nil
  for _, s in ipairs(redis.call('HKEYS', P..':src')) do
    local sk, slot = P..':sp:'..s, tonumber(s)
    for _, c in ipairs(redis.call('ZRANGEBYSCORE', sk, '-inf', now)) do
      local bk = P..':b:'..c
      local v = redis.call('GET', bk)
      local f = flags(v, slot)
      if f >= 8 then put(bk, v, slot, f - 8, nil) end
    end
    redis.call('ZREMRANGEBYSCORE', sk, '-inf', now)
    local first = redis.call('ZRANGE', sk, 0, 0, 'WITHSCORES')
    if first[2] and (low == nil or tonumber(first[2]) < low) then low = tonumber(first[2]) end
  end
  if low then redis.call('SET', P..':spnext', low) else redis.call('DEL', P..':spnext') end
end
"""

# ARGV: P, source, medium, cap, ttl_ms, engines, chains  ->  new distinct chains, or -1 over capacity
STORE = (
    _PRELUDE
    + """
local P, src, m, cap, ttl, E, C = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5], ARGV[6], ARGV[7]
local n = #C / 8
local slot = slot_for(P, src)
local nk, ek, xk, sk = P..':n:'..slot, P..':e:'..slot, P..':x:'..slot, P..':sp:'..slot
if tonumber(redis.call('HGET', nk, m) or '0') + n > cap then return -1 end
local mb, new = BIT[m], 0
for i = 0, n - 1 do
  local c = string.sub(C, 8 * i + 1, 8 * i + 8)
  local bk = P..':b:'..c
  local v = redis.call('GET', bk)
  local f = flags(v, slot)
  if bit.band(f, mb) ~= 0 then
    redis.call('HINCRBY', xk, c..m, 1)
  else
    f = f + mb
    new = new + 1
  end
  if f >= 8 then  -- a store confirms the source's speculative entry
    f = f - 8
    redis.call('ZREM', sk, c)
  end
  put(bk, v, slot, f, ttl)
  redis.call('HSET', ek, string.sub(E, 8 * i + 1, 8 * i + 8), c)
end
redis.call('HINCRBY', nk, m, new)
touch(P, slot, ttl)
return new
"""
)

# ARGV: P, source, medium, engines  ->  engine hashes not held in that medium
REMOVE = (
    _PRELUDE
    + """
local P, src, m, E = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local n = #E / 8
local slot = redis.call('HGET', P..':slot', src)
if not slot then return n end
local ek, xk, mb = P..':e:'..slot, P..':x:'..slot, BIT[m]
local unknown, gone = 0, 0
for i = 0, n - 1 do
  local e = string.sub(E, 8 * i + 1, 8 * i + 8)
  local c = redis.call('HGET', ek, e)
  local bk, v, f = nil, nil, 0
  if c then
    bk = P..':b:'..c
    v = redis.call('GET', bk)
    f = flags(v, tonumber(slot))
  end
  if bit.band(f, mb) == 0 then
    unknown = unknown + 1
  elseif tonumber(redis.call('HGET', xk, c..m) or '0') > 0 then
    if redis.call('HINCRBY', xk, c..m, -1) == 0 then redis.call('HDEL', xk, c..m) end
  else
    f = f - mb
    put(bk, v, tonumber(slot), f, nil)
    gone = gone + 1
    -- the engine id goes once the source holds the block in no medium at all
    if f % 8 == 0 then redis.call('HDEL', ek, e) end
  end
end
if gone > 0 then redis.call('HINCRBY', P..':n:'..slot, m, -gone) end
return unknown
"""
)

# ARGV: P, source, keep ("1": clear, stays listed under another slot; "0": drop)  ->  1 if it existed
RETIRE = """
local P, src, keep = ARGV[1], ARGV[2], ARGV[3]
local old = redis.call('HGET', P..':slot', src)
if not old then return 0 end
redis.call('HDEL', P..':src', old)
redis.call('SADD', P..':dead', old)
if redis.call('EXISTS', P..':sp:'..old) == 1 then redis.call('RENAME', P..':sp:'..old, P..':gsp:'..old) end
if keep == '1' then
  local new = redis.call('LPOP', P..':free')
  if not new then new = redis.call('INCR', P..':next') - 1 end
  redis.call('HSET', P..':slot', src, new)
  redis.call('HSET', P..':src', new, src)
else
  redis.call('HDEL', P..':slot', src)
end
return 1
"""

# ARGV: P, k  ->  dead slots left (call again while > 0).  Zeroes at most k blocks of one dead slot; the
# slot is reused only once all its bytes are zero.
GC = (
    _PRELUDE
    + """
local P, k = ARGV[1], tonumber(ARGV[2])
local d = redis.call('SRANDMEMBER', P..':dead')
if not d then return 0 end
local slot, ek, gk = tonumber(d), P..':e:'..d, P..':gsp:'..d
local function zero(c)
  local bk = P..':b:'..c
  local v = redis.call('GET', bk)
  if flags(v, slot) ~= 0 then put(bk, v, slot, 0, nil) end
end
local page = redis.call('HRANDFIELD', ek, k, 'WITHVALUES')
for i = 1, #page, 2 do
  zero(page[i + 1])
  redis.call('HDEL', ek, page[i])
end
if #page == 0 then
  local spec = redis.call('ZRANGE', gk, 0, k - 1)
  for _, c in ipairs(spec) do
    zero(c)
    redis.call('ZREM', gk, c)
  end
  if #spec == 0 then
    redis.call('DEL', P..':n:'..d, P..':x:'..d)
    redis.call('SREM', P..':dead', d)
    redis.call('RPUSH', P..':free', d)
  end
end
return redis.call('SCARD', P..':dead')
"""
)

# ARGV: P, source, expiry, now, ttl_ms, chains  (expiry and now on the shared clock)
ADD_SPECULATIVE = (
    _PRELUDE
    + """
local P, src, expiry, now, ttl, C = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5], ARGV[6]
clean_spec(P, now, false)
local slot = slot_for(P, src)
local sk = P..':sp:'..slot
for i = 0, #C / 8 - 1 do
  local c = string.sub(C, 8 * i + 1, 8 * i + 8)
  local bk = P..':b:'..c
  local v = redis.call('GET', bk)
  local f = flags(v, slot)
  if f < 8 then put(bk, v, slot, f + 8, ttl) else redis.call('PEXPIRE', bk, ttl) end
  redis.call('ZADD', sk, expiry, c)
end
local due = redis.call('GET', P..':spnext')
if not due or tonumber(expiry) < tonumber(due) then redis.call('SET', P..':spnext', expiry) end
redis.call('PEXPIRE', sk, ttl)
touch(P, slot, ttl)
return 0
"""
)

# ARGV: P, now  ->  speculative entries left after dropping the expired ones
SPECULATIVE_ENTRIES = (
    _PRELUDE
    + """
local P, now = ARGV[1], tonumber(ARGV[2])
clean_spec(P, now, false)
local n = 0
for _, s in ipairs(redis.call('HKEYS', P..':src')) do n = n + redis.call('ZCARD', P..':sp:'..s) end
return n
"""
)

# ARGV: P, now, refresh_ms ("0": none), keys  ->  flat [source, depth, gpu, cpu, storage, spec, ...]
# Walks the chain in order; a slot continues while it holds every block so far (a hole ends it); the walk
# stops at the first block no continuing slot holds.  Each block counts once, in its best tier.
# Blocks are fetched in doubling chunks (16, 32, ...: a miss costs one small MGET), and consecutive blocks
# with the same flags string (Lua strings are interned: one comparison) are counted as one run, so a long
# shared prefix costs a GET-equivalent per block and per-source work only where the holders change.
MATCH = (
    _PRELUDE
    + """
local P, now, refresh, K = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local w = #P + 11  -- K: the blocks' keys "P:b:<chain>" back to back, each w bytes (built by the caller)
clean_spec(P, now, false)
local live, cont = {}, {}
local srcs = redis.call('HGETALL', P..':src')
for i = 1, #srcs, 2 do
  local s = tonumber(srcs[i])
  live[s] = srcs[i + 1]
  cont[#cont + 1] = s
end
local depth, tiers = {}, {}
for _, s in ipairs(cont) do depth[s] = 0; tiers[s] = {0, 0, 0, 0} end
local pv, run = nil, 0
local function flush()
  for _, s in ipairs(cont) do
    local t = TIER[string.byte(pv, s + 1) or 0]
    depth[s] = depth[s] + run
    tiers[s][t] = tiers[s][t] + run
  end
  run = 0
end
local n, i, chunk, stop = #K / w, 0, 16, false
while i < n and not stop do
  local keys = {}
  for j = i + 1, math.min(n, i + chunk) do keys[#keys + 1] = string.sub(K, w * j - w + 1, w * j) end
  local vals = redis.call('MGET', unpack(keys))
  for j = 1, #keys do
    local v = vals[j]
    if not v then stop = true; break end
    if v ~= pv then
      if run > 0 then flush() end
      local nxt = {}
      for _, s in ipairs(cont) do
        if TIER[string.byte(v, s + 1) or 0] then nxt[#nxt + 1] = s end
      end
      if #nxt == 0 then stop = true; break end
      cont, pv = nxt, v
    end
    run = run + 1
    if refresh > 0 then redis.call('PEXPIRE', keys[j], refresh) end
  end
  i = i + #keys
  chunk = chunk * 2
end
if run > 0 then flush() end
local out = {}
for s, d in pairs(depth) do
  if d > 0 then
    local ts = tiers[s]
    for _, x in ipairs({live[s], d, ts[1], ts[2], ts[3], ts[4]}) do out[#out + 1] = x end
  end
end
return out
"""
)

# ARGV: P, source, engine  ->  chain (8 B) or nil
ENGINE_CHAIN = """
local slot = redis.call('HGET', ARGV[1]..':slot', ARGV[2])
if not slot then return false end
return redis.call('HGET', ARGV[1]..':e:'..slot, ARGV[3])
"""

# ARGV: P, source ("" for every live source)  ->  [m0, m1, m2] counts, summed over the sources asked
COUNTS = """
local P, src = ARGV[1], ARGV[2]
local slots = {}
if src == '' then
  slots = redis.call('HKEYS', P..':src')
else
  local s = redis.call('HGET', P..':slot', src)
  if s then slots = {s} end
end
local out = {0, 0, 0}
for _, s in ipairs(slots) do
  local v = redis.call('HMGET', P..':n:'..s, '0', '1', '2')
  for i = 1, 3 do out[i] = out[i] + tonumber(v[i] or '0') end
end
return out
"""
