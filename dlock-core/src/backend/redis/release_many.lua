-- release.lua for many locks of one server in one call (see batch.rs).
-- KEYS[i] lock i; ARGV[i] its owner.
-- Returns per lock 0 when freed, -1 when not held by that owner.
local out = {}
for i, key in ipairs(KEYS) do
  out[i] = free(key, ARGV[i], false)
end
return out
