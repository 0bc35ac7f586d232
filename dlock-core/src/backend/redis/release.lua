-- Give back one hold, only for its owner; announce the release to waiters.
-- KEYS[1] lock hash; ARGV[1] owner, ARGV[2] release channel.
-- Returns -1 when not held by this owner, the holds left when re-entered, 0 when freed.
if redis.call('HGET', KEYS[1], 'o') ~= ARGV[1] then
  return -1
end
local left = redis.call('HINCRBY', KEYS[1], 'n', -1)
if left > 0 then
  return left
end
redis.call('DEL', KEYS[1])
redis.call('PUBLISH', ARGV[2], '')
return 0
