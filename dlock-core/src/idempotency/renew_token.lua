-- KEYS[1] the claimed token; ARGV[1] owner, ARGV[2] lease ms. Moves the
-- lease end of this owner's claim whose lease has not run out; replies 1,
-- else 0. The TTL is kept.
local held = redis.call('GET', KEYS[1])
if not held then
  return 0
end
local owner, ends, field = string.match(held, '^([^:]*):(%d+):(%d+)$')
local now = now_ms()
if owner ~= ARGV[1] or tonumber(ends) <= now then
  return 0
end
redis.call('SET', KEYS[1], owner .. ':' .. (now + tonumber(ARGV[2])) .. ':' .. field, 'KEEPTTL')
return 1
