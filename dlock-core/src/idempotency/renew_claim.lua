-- KEYS[1] record (record.lua); ARGV[1] owner, ARGV[2] lease ms. Moves the
-- lease end of our own claim whose lease has not run out (its tail kept);
-- replies 1, else 0.
local v = redis.call('GET', KEYS[1])
if not v then
  return 0
end
local r = parse(v)
local now = now_ms()
if r.st ~= 'p' or r.owner ~= ARGV[1] or r.lease <= now then
  return 0
end
redis.call('SET', KEYS[1], encode('p', r.fp, r.owner, now + tonumber(ARGV[2]), r.bucket, r.bytes, string.sub(v, r.at)), 'KEEPTTL')
return 1
