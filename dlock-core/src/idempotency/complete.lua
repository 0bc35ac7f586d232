-- KEYS[1] record (record.lua), KEYS[2..] the pools that count it; ARGV[1]
-- owner, ARGV[2] the record as completed (record.lua; its bucket and
-- fingerprint as the claim was told), ARGV[3] the answer's bytes,
-- ARGV[4..] the pools' caps (count, bytes).
-- Replies {1} stored, {0} not this owner's claim, {4, i, ms} the answer's
-- bytes do not fit the i-th pool: nothing stored, the claim stays. The
-- record keeps its TTL (it lives that long from its claim).
-- The answer is written first and the record it replaced checked after
-- (one command, not a read and a write); a record that was not ours, or an
-- answer that does not fit, puts the old record back as it was.
local v = redis.call('SET', KEYS[1], ARGV[2], 'XX', 'GET', 'KEEPTTL')
if not v then
  return {0}
end
local r = parse(v)
if r.st ~= 'p' or r.owner ~= ARGV[1] then
  redis.call('SET', KEYS[1], v, 'KEEPTTL')
  return {0}
end
local bytes = tonumber(ARGV[3])
-- No clock here: buckets that ended are dropped by the next claim, and
-- until then the counts are only higher.
local states = tallies(2, 0, r.bucket)
local set, wait = full(2, 4, states, 0, bytes, nil)
if set > 0 then
  redis.call('SET', KEYS[1], v, 'KEEPTTL')
  return {4, set, wait}
end
count(2, states, r.bucket, 0, bytes)
return {1}
