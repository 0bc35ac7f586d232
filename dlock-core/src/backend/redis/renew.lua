-- Extend the lease, only for its owner. KEYS[1] lock hash; ARGV[1] owner, ARGV[2] lease ms.
-- Returns 1 when extended, 0 when the key is gone or someone else's.
if redis.call('HGET', KEYS[1], 'o') == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
