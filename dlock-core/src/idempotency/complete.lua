-- KEYS[1] record (record.lua), KEYS[2..] the pools that count it; ARGV[1]
-- owner, ARGV[2] encoded response, ARGV[3..] the pools' caps (count, bytes).
-- Replies {1} stored, {0} not this owner's claim, {4, i, ms} the answer's
-- bytes do not fit the i-th pool: nothing stored, the claim stays. The
-- record keeps its TTL (it lives that long from its claim).
local v = redis.call('GET', KEYS[1])
if not v then
  return {0}
end
local r = parse(v)
if r.st ~= 'p' or r.owner ~= ARGV[1] then
  return {0}
end
local bytes = #ARGV[2]
-- No clock here: buckets that ended are dropped by the next claim, and
-- until then the counts are only higher.
local states = tallies(2, 0, r.bucket)
local set, wait = full(2, 3, states, 0, bytes, nil)
if set > 0 then
  return {4, set, wait}
end
redis.call('SET', KEYS[1], encode('c', r.fp, '', 0, r.bucket, r.bytes + bytes, ARGV[2]), 'KEEPTTL')
count(2, states, r.bucket, 0, bytes)
return {1}
