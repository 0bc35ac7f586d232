-- KEYS[1] the fresh token, KEYS[2..] the sets that count it; ARGV[1] ttl ms,
-- ARGV[2] member, ARGV[3..] the caps of KEYS[2..].
-- Replies {0} issued, {i, ms} the i-th set is full.
local now = now_ms()
local set, wait = full(2, 3, now)
if set > 0 then
  return {set, wait}
end
redis.call('SET', KEYS[1], 1, 'PX', ARGV[1])
count(2, ARGV[2], now + tonumber(ARGV[1]))
return {0}
