-- Take the lock, or re-enter it, or report how long the holder has left.
-- KEYS[1] lock hash {o = owner, n = holds, f = fencing token}
-- KEYS[2] fencing counter (same hash tag, so same cluster slot)
-- ARGV[1] owner token, ARGV[2] lease in ms, ARGV[3] counter life in seconds
-- Returns {1, fencing token, holds} when granted (holds > 1: a re-entry),
-- {0, remaining ms of the holder} when held.
local holder = redis.call('HGET', KEYS[1], 'o')
if holder == false then
  -- The token is max(last + 1, server time in us): it keeps growing even if
  -- the counter key expires or is lost, as long as the server clock does not
  -- step back.
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local last = tonumber(redis.call('GET', KEYS[2]) or '0')
  local token = math.max(last + 1, now)
  redis.call('SET', KEYS[2], string.format('%d', token), 'EX', ARGV[3])
  redis.call('HSET', KEYS[1], 'o', ARGV[1], 'n', 1, 'f', string.format('%d', token))
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1, token, 1}
end
if holder == ARGV[1] then
  local holds = redis.call('HINCRBY', KEYS[1], 'n', 1)
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1, tonumber(redis.call('HGET', KEYS[1], 'f')), holds}
end
return {0, redis.call('PTTL', KEYS[1])}
