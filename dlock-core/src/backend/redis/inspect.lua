-- Reads lock KEYS[1] for an operator (Locker::inspect), changing nothing.
-- Returns {server time in ms, 's', PTTL, the lock string} for a lock held
-- by one (take.lua), {server time in ms, 'h', field, value, ...} for a
-- counted key (counted.lua), {server time in ms} for a free key. Every
-- value is text.
local t = redis.call('TIME')
local now = tostring(tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
local kind = redis.call('TYPE', KEYS[1]).ok
if kind == 'string' then
  return {now, 's', tostring(redis.call('PTTL', KEYS[1])), redis.call('GET', KEYS[1])}
elseif kind == 'hash' then
  local out = {now, 'h'}
  for _, v in ipairs(redis.call('HGETALL', KEYS[1])) do
    out[#out + 1] = v
  end
  return out
end
return {now}
