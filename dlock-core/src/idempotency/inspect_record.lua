-- Reads record KEYS[1] (record.lua) for an operator
-- (IdempotencyStore::inspect_record), changing nothing. Returns {server
-- time in ms, PTTL, the record} or, with no record, {server time in ms}:
-- a claim's lease end is on this server's clock.
local t = redis.call('TIME')
local now = tostring(tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
local v = redis.call('GET', KEYS[1])
if not v then
  return {now}
end
return {now, tostring(redis.call('PTTL', KEYS[1])), v}
