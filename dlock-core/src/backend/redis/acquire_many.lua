-- acquire.lua for many locks of one server in one call (see coalesce.rs):
-- one `TIME` and one high-water mark update for all of them, consecutive
-- tokens for the locks granted.
-- KEYS[1] high-water mark, KEYS[2] the restart-quarantine data marker when
-- ARGV[1] = '1' (else unused), KEYS[i + 2] lock i;
-- ARGV[3i - 1] owner, ARGV[3i] lease in ms, ARGV[3i + 1] awaited ('1'/'0')
-- of lock i, as in acquire.lua.
-- Returns {2} when the marker is gone (nothing granted), else per lock
-- {1, token, 1} granted, {1, token, 2} joined, {0, holder's ms, 0} held.
if ARGV[1] == '1' and redis.call('EXISTS', KEYS[2]) == 0 then
  return {2}
end
local t = redis.call('TIME')
local base = tonumber(t[1]) * 1000000 + tonumber(t[2])
local last = tonumber(redis.call('SET', KEYS[1], string.format('%d', base), 'GET') or '0')
local fixed = last >= base
if fixed then
  base = last + 1
end
local granted = 0
local out = {}
for i = 3, #KEYS do
  local j = (i - 2) * 3 - 1
  local owner, w = ARGV[j], ARGV[j + 2] == '1' and '1' or '0'
  local token = base + granted
  local text = string.format('%d', token)
  local held = redis.call('SET', KEYS[i], text .. ':' .. w .. ':' .. owner, 'NX', 'PX', ARGV[j + 1], 'GET')
  if not held then
    granted = granted + 1
    out[#out + 1] = 1
    out[#out + 1] = token
    out[#out + 1] = 1
  else
    local fence, waited, holder = string.match(held, '^(%d+):([01]):(.*)$')
    if holder == owner then
      if redis.call('PTTL', KEYS[i]) < tonumber(ARGV[j + 1]) then
        redis.call('PEXPIRE', KEYS[i], ARGV[j + 1])
      end
      if w == '1' and waited == '0' then
        redis.call('SET', KEYS[i], fence .. ':1:' .. holder, 'KEEPTTL')
      end
      out[#out + 1] = 1
      out[#out + 1] = tonumber(fence)
      out[#out + 1] = 2
    else
      if w == '1' and waited == '0' then
        redis.call('SET', KEYS[i], fence .. ':1:' .. holder, 'KEEPTTL')
      end
      out[#out + 1] = 0
      out[#out + 1] = redis.call('PTTL', KEYS[i])
      out[#out + 1] = 0
    end
  end
end
-- The mark holds the last token handed out (base itself when none or one).
if granted > 1 or fixed then
  redis.call('SET', KEYS[1], string.format('%d', base + math.max(granted, 1) - 1))
end
return out
