-- KEYS[1] record (record.lua), KEYS[2] the restart quarantine's data marker
-- when ARGV[4] is '1' (else unused), KEYS[3..] the pools that count it
-- (ledger.lua); ARGV[1] fingerprint, ARGV[2] owner, ARGV[3] lease ms,
-- ARGV[5] record ttl ms, ARGV[6] '1' when a claim whose lease ran out is
-- taken afresh, ARGV[7] `<scope's length>:<scope><key>` (the claim's tail,
-- after its time: record.lua), ARGV[8..] the pools' caps (count, bytes).
-- Replies {0, bucket} claimed (the bucket its pools count it in), {1} in progress, {2, response} completed, {3} mismatch,
-- {4, i, ms} the i-th pool is full (its earliest bucket ends in ms), {5} the
-- data marker is gone: the server lost its records, nothing is answered;
-- {6} claimed by a request whose lease ran out without an answer.
if ARGV[4] == '1' and redis.call('EXISTS', KEYS[2]) == 0 then
  return {5}
end
local now = now_ms()
local field = bucket(now, tonumber(ARGV[5]))
local tail = now .. ':' .. ARGV[7]
-- One command claims a new key and reads an existing one.
local v = redis.call('SET', KEYS[1], encode('p', ARGV[1], ARGV[2], now + tonumber(ARGV[3]), field, 0, tail), 'NX', 'GET',
  'PX', ARGV[5])
if v then
  -- An existing record is answered whatever the caps: a retry is replayed.
  local r = parse(v)
  if r.fp ~= ARGV[1] then
    return {3}
  end
  if r.st == 'c' then
    return {2, string.sub(v, r.at)}
  end
  if r.lease > now then
    return {1}
  end
  if ARGV[6] ~= '1' then
    return {6}
  end
  redis.call('SET', KEYS[1], encode('p', r.fp, ARGV[2], now + tonumber(ARGV[3]), r.bucket, r.bytes, tail), 'KEEPTTL')
  return {0, r.bucket}
end
local states = tallies(3, now, field)
local set, wait = full(3, 8, states, 1, 0, now)
if set > 0 then
  redis.call('DEL', KEYS[1])
  return {4, set, wait}
end
count(3, states, field, 1, 0)
return {0, field}
