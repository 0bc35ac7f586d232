-- A fenced access to a Redis value (dlock_core::fence::redis).
-- KEYS[1] the value, KEYS[2] the highest token seen for it
-- ARGV[1] the token (decimal), ARGV[2] 'get' or 'set', ARGV[3] the value to set
-- Returns {1, value} (a get; nil when missing), {1, nil} (a set), or
-- {0, highest token} when a higher token came first: nothing changed.
-- Tokens are compared as decimal text (length, then bytes): exact for every
-- u64, where Lua's numbers are doubles.
local token = ARGV[1]
local newest = redis.call('GET', KEYS[2]) or '0'
if #token < #newest or (#token == #newest and token < newest) then
  return {0, newest}
end
if token ~= newest then
  redis.call('SET', KEYS[2], token)
end
if ARGV[2] == 'set' then
  redis.call('SET', KEYS[1], ARGV[3])
  return {1, false}
end
return {1, redis.call('GET', KEYS[1])}
