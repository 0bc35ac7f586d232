-- Prepended to acquire.lua, acquire_many.lua and raise_mark.lua (see mod.rs).
-- The server clock in microseconds as decimal text: seconds and zero-padded
-- microseconds, so the common path converts no number to text or back.
local function clock_text()
  local t = redis.call('TIME')
  local us = t[2]
  if #us < 6 then
    us = string.sub('00000', #us) .. us
  end
  return t[1] .. us
end

-- Whether token text `a` is at least `b`: both are decimal without leading
-- zeros, so the longer is the larger, and equal lengths compare as strings.
local function at_least(a, b)
  return #a > #b or (#a == #b and a >= b)
end

