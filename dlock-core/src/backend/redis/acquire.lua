-- Take the lock, or join our own owner's hold, or report how long the
-- holders have left (clock.lua, counted.lua and take.lua are prepended).
-- KEYS[1] lock. KEYS[2] high-water mark: the last fencing token granted.
-- One key for all locks of a single server, one per hash slot in a cluster
-- (same slot as KEYS[1]), without TTL: released locks leave nothing of
-- their own behind.
-- ARGV[1] owner token, ARGV[2] lease in ms, ARGV[3] '1' when the caller
-- waits for release announcements, ARGV[4] the mode ('x', 's', 'p<N>'),
-- ARGV[5] how long a waiting caller may still wait, in ms (see take.lua).
-- KEYS[3], ARGV[6] = '1' (only with the restart quarantine): a data marker
-- without TTL; when it is gone the server lost its data, and nothing is
-- granted (the client quarantines it, see restart.rs).
-- Returns the fencing token (decimal text, the cheapest reply) when granted,
-- {1, fencing token, 2} when the owner held it already (a hold of the same
-- owner the engine had given up as lost), {0, remaining ms of the holder}
-- when held, {3, mode held} when held in a mode that does not fit (see
-- take.lua), {2} when the marker is gone.
if ARGV[6] == '1' and redis.call('EXISTS', KEYS[3]) == 0 then
  return {2}
end
-- The token is max(last + 1, server time in us). The high-water mark is
-- shared by many keys, so every key's tokens grow strictly while it lives;
-- the clock keeps them growing when it is lost in a restart, lags on a
-- promoted replica or is deleted, as long as the server clock does not step
-- back. SET ... GET writes the common case (the clock is ahead) and reads
-- the last token in one call. It is computed before the lock is tried, so
-- that a free lock costs one SET NX: a try that finds it held moves the mark
-- for nothing, which only costs the contended path a write.
local text = clock_text()
local last = redis.call('SET', KEYS[2], text, 'GET')
if last and at_least(last, text) then
  text = string.format('%d', last + 1)
  redis.call('SET', KEYS[2], text)
end
local outcome, value = take(KEYS[1], text, ARGV[3] == '1' and '1' or '0', ARGV[1], ARGV[2], ARGV[4], ARGV[5])
if outcome == 1 then
  return text
elseif outcome == 2 then
  return {1, value, 2}
elseif outcome == 3 then
  return {3, value}
end
return {0, value}
