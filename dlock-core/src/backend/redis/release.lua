-- Free the lock, only for its owner; announce the release when someone
-- waits for it (an acquire that found the lock held set `w`).
-- KEYS[1] lock '<token>:<w>:<owner>'; ARGV[1] owner.
-- Returns 0 when freed, -1 when not held by this owner. Re-entries are
-- counted by the client (holds.rs): this runs for its last hold only.
-- The lock's fencing token needs no keeping: the high-water mark the
-- acquire script advanced is above it.
local lock = redis.call('GET', KEYS[1])
if not lock then
  return -1
end
-- The token is digits only, so the first ':' ends it, `w` follows and the
-- owner is the rest from two bytes later: plain finds, no pattern, no copy.
local colon = string.find(lock, ':', 1, true)
if not colon or #lock ~= colon + 2 + #ARGV[1] or string.find(lock, ARGV[1], colon + 3, true) ~= colon + 3 then
  return -1
end
redis.call('DEL', KEYS[1])
if string.byte(lock, colon + 1) == 49 then
  -- '1': the channel the waiters subscribed to (release_channel in mod.rs).
  redis.call('PUBLISH', KEYS[1] .. ':released', '')
end
return 0
