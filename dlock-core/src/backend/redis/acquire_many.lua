-- acquire.lua for many locks of one server in one call (see batch.rs):
-- one `TIME` and one high-water mark update for all of them, consecutive
-- tokens for the locks granted (clock.lua, counted.lua and take.lua are
-- prepended).
-- KEYS[1] high-water mark, KEYS[2] the restart-quarantine data marker when
-- ARGV[1] = '1' (else unused), KEYS[i + 2] lock i;
-- ARGV[5i - 3 .. 5i + 1] owner, lease in ms, awaited ('1'/'0'), mode and
-- wait in ms of lock i, as ARGV[1 .. 5] in acquire.lua.
-- Returns {2} when the marker is gone (nothing granted), else per lock
-- {1, token, 1} granted, {1, token, 2} joined, {0, holder's ms, 0} held,
-- {3, mode held, 0} held in a mode that does not fit (tokens as decimal
-- text).
if ARGV[1] == '1' and redis.call('EXISTS', KEYS[2]) == 0 then
  return {2}
end
local text = clock_text()
local last = redis.call('SET', KEYS[1], text, 'GET')
local fixed = last and at_least(last, text)
local base = tonumber(fixed and last or text)
if fixed then
  base = base + 1
end
local granted = 0
local out = {}
-- Entries in `out` so far.
local n = 0
for i = 3, #KEYS do
  local j = i * 5 - 13
  -- The clock's own text for the first grant, formatted only after it.
  local token = (granted == 0 and not fixed) and text or string.format('%d', base + granted)
  local outcome, value = take(KEYS[i], token, ARGV[j + 2] == '1' and '1' or '0', ARGV[j], ARGV[j + 1], ARGV[j + 3], ARGV[j + 4])
  if outcome == 1 then
    granted = granted + 1
    out[n + 1] = 1
    out[n + 3] = 1
  elseif outcome == 2 then
    out[n + 1] = 1
    out[n + 3] = 2
  else
    out[n + 1] = outcome
    out[n + 3] = 0
  end
  out[n + 2] = value
  n = n + 3
end
if granted > 1 or fixed then
  redis.call('SET', KEYS[1], string.format('%d', base + math.max(granted, 1) - 1))
end
return out
