-- KEYS[1] the claimed token, KEYS[2] its fresh name (one slot: hash tags);
-- ARGV[1] owner. Replies 1 when given back (renamed, TTL kept), 0 when it
-- is not this owner's claim.
local held = redis.call('GET', KEYS[1])
if not held then
  return 0
end
local owner, field = string.match(held, '^([^:]*):%d+:(%d+)$')
if owner ~= ARGV[1] then
  return 0
end
redis.call('RENAME', KEYS[1], KEYS[2])
redis.call('SET', KEYS[2], field, 'KEEPTTL')
return 1
