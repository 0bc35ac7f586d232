-- Extend the leases of many locks in one call, each only for its owner.
-- KEYS[i] lock '<token>:<w>:<owner>'; ARGV[2i - 1] its owner, ARGV[2i] its
-- lease in ms.
-- Returns, per key, 1 when extended, 0 when the key is gone or someone else's.
local extended = {}
for i, key in ipairs(KEYS) do
  local lock = redis.call('GET', key)
  if lock and string.match(lock, '^%d+:[01]:(.*)$') == ARGV[2 * i - 1] then
    redis.call('PEXPIRE', key, ARGV[2 * i])
    extended[i] = 1
  else
    extended[i] = 0
  end
end
return extended
