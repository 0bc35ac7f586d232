-- KEYS[1] the claimed token's name, KEYS[2..] the pools that count it;
-- ARGV[1] the claim's owner. One DEL: only the caller whose DEL counted 1
-- proceeds.
local v = redis.call('GET', KEYS[1])
if not v then
  return 0
end
local owner, field = string.match(v, '^([^:]*):%d+:(%d+)$')
if owner ~= ARGV[1] then
  return 0
end
if redis.call('DEL', KEYS[1]) == 1 then
  uncount(2, field, 1, 0)
  return 1
end
return 0
