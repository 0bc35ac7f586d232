-- KEYS[1] record; ARGV[1] fingerprint, ARGV[2] owner, ARGV[3] lease ms.
-- Replies {0} claimed, {1} in progress, {2, response} completed, {3} mismatch.
local state = redis.call('HGET', KEYS[1], 's')
if not state then
  redis.call('HSET', KEYS[1], 's', 'p', 'f', ARGV[1], 'o', ARGV[2])
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {0}
end
if redis.call('HGET', KEYS[1], 'f') ~= ARGV[1] then
  return {3}
end
if state == 'p' then
  return {1}
end
return {2, redis.call('HGET', KEYS[1], 'r')}
