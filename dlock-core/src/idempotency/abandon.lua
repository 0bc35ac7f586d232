-- KEYS[1] record (record.lua), KEYS[2..] the pools that count it; ARGV[1]
-- owner. Deletes only our own in-progress record; replies 1, else 0.
local v = redis.call('GET', KEYS[1])
if not v then
  return 0
end
local r = parse(v)
if r.st ~= 'p' or r.owner ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
uncount(2, r.bucket, 1, r.bytes)
return 1
