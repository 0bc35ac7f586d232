-- Extend the leases of many locks in one call, each only for its owner
-- (counted.lua is prepended).
-- KEYS[i] lock '<token>:<flag>:<owner>' (take.lua), or a counted key; ARGV[2i - 1] its
-- owner, ARGV[2i] its lease in ms.
-- Returns, per key, 1 when extended, 0 when the key is gone or someone else's.

-- The owner's hold in counted key `key`, its lease now `lease` ms from now.
local function renew_counted(key, owner, lease)
  local now = now_ms()
  local s = live(key, now)
  local mine = s.holders[owner]
  if not mine then
    keep_until(key, s)
    return 0
  end
  mine[2] = now + tonumber(lease)
  redis.call('HSET', key, owner, string.format('%s:%d', mine[1], mine[2]))
  s.last = 0
  for _, h in pairs(s.holders) do
    s.last = math.max(s.last, h[2])
  end
  keep_until(key, s)
  return 1
end

local extended = {}
for i, key in ipairs(KEYS) do
  local lock = redis.pcall('GET', key)
  if wrong_type(lock) then
    extended[i] = renew_counted(key, ARGV[2 * i - 1], ARGV[2 * i])
  elseif lock and string.match(lock, '^%d+:[^:]+:(.*)$') == ARGV[2 * i - 1] then
    redis.call('PEXPIRE', key, ARGV[2 * i])
    extended[i] = 1
  else
    extended[i] = 0
  end
end
return extended
