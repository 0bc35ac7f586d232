-- KEYS[1] record, KEYS[2..] the sets that count it; ARGV[1] owner,
-- ARGV[2] encoded response, ARGV[3] ttl ms, ARGV[4] member.
local record = redis.call('HMGET', KEYS[1], 's', 'o')
if record[1] ~= 'p' or record[2] ~= ARGV[1] then
  return 0
end
redis.call('HSET', KEYS[1], 's', 'c', 'r', ARGV[2])
redis.call('HDEL', KEYS[1], 'o', 'l')
redis.call('PEXPIRE', KEYS[1], ARGV[3])
count(2, ARGV[4], now_ms() + tonumber(ARGV[3]))
return 1
