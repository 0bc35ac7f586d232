-- KEYS[1] record, KEYS[2] the restart quarantine's data marker when ARGV[5]
-- is '1' (else unused), KEYS[3..] the sets that count it (ledger.lua);
-- ARGV[1] fingerprint, ARGV[2] owner, ARGV[3] lease ms, ARGV[4] member,
-- ARGV[6] record ttl ms, ARGV[7] '1' when a claim whose lease ran out is
-- taken afresh, ARGV[8..] the caps of KEYS[3..].
-- The record is a hash: `s` state (`p` claimed, `c` completed), `f`
-- fingerprint, `o` owner and `l` lease end (ms of this server's clock)
-- while claimed, `r` the response once completed.
-- Replies {0} claimed, {1} in progress, {2, response} completed, {3} mismatch,
-- {4, i, ms} the i-th set is full (its oldest member expires in ms), {5} the
-- data marker is gone: the server lost its records, nothing is answered;
-- {6} claimed by a request whose lease ran out without an answer.
if ARGV[5] == '1' and redis.call('EXISTS', KEYS[2]) == 0 then
  return {5}
end
local record = redis.call('HMGET', KEYS[1], 's', 'f', 'l')
local now = now_ms()
if record[1] then
  -- An existing record is answered whatever the caps: a retry is replayed.
  if record[2] ~= ARGV[1] then
    return {3}
  end
  if record[1] == 'c' then
    return {2, redis.call('HGET', KEYS[1], 'r')}
  end
  if tonumber(record[3]) > now then
    return {1}
  end
  if ARGV[7] ~= '1' then
    return {6}
  end
  redis.call('HSET', KEYS[1], 'o', ARGV[2], 'l', now + tonumber(ARGV[3]))
  return {0}
end
local set, wait = full(3, 8, now)
if set > 0 then
  return {4, set, wait}
end
redis.call('HSET', KEYS[1], 's', 'p', 'f', ARGV[1], 'o', ARGV[2], 'l', now + tonumber(ARGV[3]))
redis.call('PEXPIRE', KEYS[1], ARGV[6])
count(3, ARGV[4], now + tonumber(ARGV[6]))
return {0}
