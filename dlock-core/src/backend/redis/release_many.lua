-- release.lua for many locks of one server in one call (see coalesce.rs).
-- KEYS[i] lock i; ARGV[i] its owner.
-- Returns per lock 0 when freed, -1 when not held by that owner.
local out = {}
for i, key in ipairs(KEYS) do
  local lock = redis.call('GET', key)
  local colon = lock and string.find(lock, ':', 1, true)
  local owner = ARGV[i]
  if colon and #lock == colon + 2 + #owner and string.find(lock, owner, colon + 3, true) == colon + 3 then
    redis.call('DEL', key)
    if string.byte(lock, colon + 1) == 49 then
      redis.call('PUBLISH', key .. ':released', '')
    end
    out[i] = 0
  else
    out[i] = -1
  end
end
return out
