-- Prepended to release.lua and release_many.lua (see mod.rs): what each
-- release does to its one lock, written once.
-- free(key, owner) deletes lock `key` '<token>:<w>:<owner>' only for its
-- owner, and announces the release on `key:released` when someone waits
-- for it (`w` = '1'; the channel is release_channel in mod.rs). The lock's
-- fencing token needs no keeping: the high-water mark the acquire advanced
-- is above it. Returns 0 when freed, -1 when not held by this owner.
local function free(key, owner)
  local lock = redis.call('GET', key)
  if not lock then
    return -1
  end
  -- The token is digits only, so the first ':' ends it, `w` follows and the
  -- owner is the rest from two bytes later: plain finds, no pattern, no copy.
  local colon = string.find(lock, ':', 1, true)
  if not colon or #lock ~= colon + 2 + #owner or string.find(lock, owner, colon + 3, true) ~= colon + 3 then
    return -1
  end
  redis.call('DEL', key)
  if string.byte(lock, colon + 1) == 49 then
    redis.call('PUBLISH', key .. ':released', '')
  end
  return 0
end

