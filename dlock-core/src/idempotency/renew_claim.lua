-- KEYS[1] record; ARGV[1] owner, ARGV[2] lease ms. Moves the lease end of
-- our own claim whose lease has not run out; replies 1, else 0.
local record = redis.call('HMGET', KEYS[1], 's', 'o', 'l')
local now = now_ms()
if record[1] ~= 'p' or record[2] ~= ARGV[1] or tonumber(record[3]) <= now then
  return 0
end
redis.call('HSET', KEYS[1], 'l', now + tonumber(ARGV[2]))
return 1
