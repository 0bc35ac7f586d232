-- KEYS[1] record, KEYS[2] the restart quarantine's data marker when ARGV[5]
-- is '1' (else unused), KEYS[3..] the sets that count it (ledger.lua);
-- ARGV[1] fingerprint, ARGV[2] owner, ARGV[3] lease ms, ARGV[4] member,
-- ARGV[6..] the caps of KEYS[3..].
-- Replies {0} claimed, {1} in progress, {2, response} completed, {3} mismatch,
-- {4, i, ms} the i-th set is full (its oldest member expires in ms), {5} the
-- data marker is gone: the server lost its records, nothing is answered.
if ARGV[5] == '1' and redis.call('EXISTS', KEYS[2]) == 0 then
  return {5}
end
local state = redis.call('HGET', KEYS[1], 's')
if state then
  -- An existing record is answered whatever the caps: a retry is replayed.
  if redis.call('HGET', KEYS[1], 'f') ~= ARGV[1] then
    return {3}
  end
  if state == 'p' then
    return {1}
  end
  return {2, redis.call('HGET', KEYS[1], 'r')}
end
local now = now_ms()
local set, wait = full(3, 6, now)
if set > 0 then
  return {4, set, wait}
end
redis.call('HSET', KEYS[1], 's', 'p', 'f', ARGV[1], 'o', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
count(3, ARGV[4], now + tonumber(ARGV[3]))
return {0}
