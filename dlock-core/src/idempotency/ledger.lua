-- Prepended to the scripts that count live records or tokens. KEYS[first..]
-- are sorted sets (the caller's, then the total), each scoring a member by
-- its expiry in ms of this server's clock, so what expired by TTL stops
-- counting at the next ZREMRANGEBYSCORE: a count can never leak.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Live members per set, as `full` counted them (for `count`).
local cards = {}

-- The first set (1-based among KEYS[first..]) that is full against its cap
-- in ARGV[maxes + i - 1], and the ms until its oldest member expires; 0, 0
-- when every set has room.
local function full(first, maxes, now)
  for i = first, #KEYS do
    redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now)
    cards[i] = redis.call('ZCARD', KEYS[i])
    if cards[i] >= tonumber(ARGV[maxes + i - first]) then
      local oldest = redis.call('ZRANGE', KEYS[i], 0, 0, 'WITHSCORES')
      return i - first + 1, math.max(tonumber(oldest[2]) - now, 1)
    end
  end
  return 0, 0
end

-- Counts `member` until `expires` in every set. A caller's set lives as
-- long as its last member, so the set of a caller who never comes back is
-- not left behind; the total set (`...:all`) needs no TTL: every claim trims
-- it, and Redis deletes a set that is trimmed empty.
-- A set with members has a TTL (they were counted here), which only ever
-- moves later (`GT`); `GT` counts a key without TTL as never expiring, so
-- a set this call creates gets its first TTL plainly. Whether it is new is
-- known from `full`'s count, or else from the set holding only `member`.
local function count(first, member, expires)
  for i = first, #KEYS do
    local added = redis.call('ZADD', KEYS[i], expires, member)
    if string.sub(KEYS[i], -4) ~= ':all' then
      if cards[i] == 0 then
        redis.call('PEXPIREAT', KEYS[i], expires)
      elseif redis.call('PEXPIREAT', KEYS[i], expires, 'GT') == 0 and cards[i] == nil and added == 1
          and redis.call('ZCARD', KEYS[i]) == 1 then
        redis.call('PEXPIREAT', KEYS[i], expires)
      end
    end
  end
end

local function uncount(first, member)
  for i = first, #KEYS do
    redis.call('ZREM', KEYS[i], member)
  end
end

