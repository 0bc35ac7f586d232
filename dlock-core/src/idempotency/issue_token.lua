-- KEYS[1] the fresh token, KEYS[2..] the pools that count it; ARGV[1] ttl
-- ms, ARGV[2..] the pools' caps (count, bytes). A fresh token's value is
-- the bucket its pools count it in.
-- Replies {0} issued, {i, ms} the i-th pool is full.
local now = now_ms()
local field = bucket(now, tonumber(ARGV[1]))
local states = tallies(2, now, field)
local set, wait = full(2, 2, states, 1, 0, now)
if set > 0 then
  return {set, wait}
end
redis.call('SET', KEYS[1], field, 'PX', ARGV[1])
count(2, states, field, 1, 0)
return {0}
