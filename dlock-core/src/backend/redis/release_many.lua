-- release.lua for many locks of one server in one call (see coalesce.rs).
-- KEYS[i] lock i; ARGV[2i - 1] its owner, ARGV[2i] its release channel.
-- Returns per lock 0 when freed, -1 when not held by that owner.
local out = {}
for i, key in ipairs(KEYS) do
  local lock = redis.call('GET', key)
  local waited, owner
  if lock then
    waited, owner = string.match(lock, '^%d+:([01]):(.*)$')
  end
  if owner == ARGV[2 * i - 1] then
    redis.call('DEL', key)
    if waited == '1' then
      redis.call('PUBLISH', ARGV[2 * i], '')
    end
    out[i] = 0
  else
    out[i] = -1
  end
end
return out
