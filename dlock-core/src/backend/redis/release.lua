-- Give back one hold, only for its owner; announce the release when someone
-- waits for it (an acquire that found the lock held set `w`).
-- KEYS[1] lock hash; ARGV[1] owner, ARGV[2] release channel.
-- Returns -1 when not held by this owner, the holds left when re-entered, 0 when freed.
-- The lock's fencing token needs no keeping: the high-water mark the
-- acquire script advanced is above it.
local lock = redis.call('HMGET', KEYS[1], 'o', 'n', 'w')
if lock[1] ~= ARGV[1] then
  return -1
end
local extra = tonumber(lock[2] or '0')
if extra > 0 then
  return redis.call('HINCRBY', KEYS[1], 'n', -1) + 1
end
redis.call('DEL', KEYS[1])
if lock[3] then
  redis.call('PUBLISH', ARGV[2], '')
end
return 0
