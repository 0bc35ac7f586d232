-- Free the lock, only for its owner; announce the release when someone
-- waits for it (an acquire that found the lock held set `w`).
-- KEYS[1] lock '<token>:<w>:<owner>'; ARGV[1] owner, ARGV[2] release channel.
-- Returns 0 when freed, -1 when not held by this owner. Re-entries are
-- counted by the client (holds.rs): this runs for its last hold only.
-- The lock's fencing token needs no keeping: the high-water mark the
-- acquire script advanced is above it.
local lock = redis.call('GET', KEYS[1])
if not lock then
  return -1
end
local waited, owner = string.match(lock, '^%d+:([01]):(.*)$')
if owner ~= ARGV[1] then
  return -1
end
redis.call('DEL', KEYS[1])
if waited == '1' then
  redis.call('PUBLISH', ARGV[2], '')
end
return 0
