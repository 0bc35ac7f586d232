-- Prepended to every idempotency script. KEYS[first..] are pools: hashes
-- that count the live records (or tokens) of one caller, or of all (on a
-- Redis Cluster, of one shard of all: redis/layout.rs), and their bytes, by
-- the time they expire. A pool's fields:
--   `t`     "count:bytes" of what it counts;
--   `o`     the earliest end among its buckets, `m` the latest;
--   `<end>` "count:bytes" of the entries that expire by `end` (ms of this
--           server's clock), a bucket a 64th of their TTL wide.
-- An entry counts until its bucket ends, at most a 64th of its TTL after it
-- expired: the counts are never below what lives, and reading or changing
-- one is two commands (HMGET, HSET) whatever the pool holds. The buckets
-- that ended are dropped when `o` says one did (once per bucket).
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function pair(v)
  if not v then
    return 0, 0
  end
  local c, b = string.match(v, '^(-?%d+):(-?%d+)$')
  return tonumber(c) or 0, tonumber(b) or 0
end

-- The bucket an entry that lives `ttl` ms from `now` counts in.
local function bucket(now, ttl)
  local width = math.max(math.floor(ttl / 64), 1)
  return (math.floor((now + ttl) / width) + 1) * width
end

-- Reads `pool` for a change to bucket `field`: {n, z, o, m, cur}.
local function tally(pool, now, field)
  local v = redis.call('HMGET', pool, 't', 'o', 'm', field)
  local s = {}
  s.n, s.z = pair(v[1])
  s.o, s.m, s.cur = tonumber(v[2]), tonumber(v[3]), v[4]
  if s.o and s.o <= now then
    local all = redis.call('HGETALL', pool)
    local dead, first = {}, nil
    for j = 1, #all, 2 do
      local ends = tonumber(all[j])
      if ends and ends <= now then
        local c, b = pair(all[j + 1])
        s.n, s.z = s.n - c, s.z - b
        dead[#dead + 1] = all[j]
      elseif ends and (not first or ends < first) then
        first = ends
      end
    end
    if #dead > 0 then
      redis.call('HDEL', pool, unpack(dead))
    end
    s.o = first
    if not first then
      redis.call('HDEL', pool, 'o')
    end
    redis.call('HSET', pool, 't', s.n .. ':' .. s.z)
  end
  return s
end

-- The first pool (1-based among KEYS[first..]) where `n` more entries of
-- `z` more bytes do not fit, against the caps ARGV[caps + 2(i-1)] (count)
-- and ARGV[caps + 2(i-1) + 1] (bytes), and the ms until its earliest
-- bucket ends; 0, 0 when all fit. `states[i]` are the pools' tallies;
-- `now` may be nil (the clock is read only for a refusal).
local function full(first, caps, states, n, z, now)
  for i = first, #KEYS do
    local s = states[i]
    local j = caps + 2 * (i - first)
    if s.n + n > tonumber(ARGV[j]) or s.z + z > tonumber(ARGV[j + 1]) then
      now = now or now_ms()
      return i - first + 1, math.max((s.o or now + 1) - now, 1)
    end
  end
  return 0, 0
end

-- Tallies the pools KEYS[first..] for bucket `field`.
local function tallies(first, now, field)
  local states = {}
  for i = first, #KEYS do
    states[i] = tally(KEYS[i], now, field)
  end
  return states
end

-- Counts `n` entries and `z` bytes more in bucket `field` of every pool.
-- A pool lives as long as its latest bucket.
local function count(first, states, field, n, z)
  local ends = tonumber(field)
  for i = first, #KEYS do
    local s = states[i]
    local c, b = pair(s.cur)
    local args = {'t', (s.n + n) .. ':' .. (s.z + z), field, (c + n) .. ':' .. (b + z)}
    if not s.o or ends < s.o then
      args[#args + 1] = 'o'
      args[#args + 1] = field
    end
    if not s.m or ends > s.m then
      args[#args + 1] = 'm'
      args[#args + 1] = field
    end
    redis.call('HSET', KEYS[i], unpack(args))
    if not s.m or ends > s.m then
      redis.call('PEXPIREAT', KEYS[i], ends)
    end
  end
end

-- Takes `n` entries and `z` bytes out of bucket `field` of every pool
-- KEYS[first..], unless the bucket already ended (it was dropped whole).
local function uncount(first, field, n, z)
  for i = first, #KEYS do
    local v = redis.call('HMGET', KEYS[i], 't', field)
    if v[2] then
      local tn, tz = pair(v[1])
      local c, b = pair(v[2])
      redis.call('HSET', KEYS[i], 't', (tn - n) .. ':' .. (tz - z), field, (c - n) .. ':' .. (b - z))
    end
  end
end
