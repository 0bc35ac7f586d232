-- Take the lock, or re-enter it, or report how long the holder has left.
-- KEYS[1] lock hash {o = owner, f = fencing token, n = extra holds (absent
-- for a single hold), w = someone waits}
-- KEYS[2] high-water mark: the last fencing token granted. One key for all
-- locks of a single server, one per hash slot in a cluster (same slot as
-- KEYS[1]), without TTL: released locks leave nothing of their own behind.
-- ARGV[1] owner token, ARGV[2] lease in ms,
-- ARGV[3] '1' when the caller waits for release announcements: mark the lock
-- as awaited, held or granted (a winning waiter may have others parked behind
-- it in its process, which only its release will wake)
-- KEYS[3], ARGV[4] = '1' (only with the restart quarantine): a data marker
-- without TTL; when it is gone the server lost its data, and nothing is
-- granted (the client quarantines it, see restart.rs).
-- Returns {1, fencing token, holds} when granted (holds > 1: a re-entry),
-- {0, remaining ms of the holder} when held, {2} when the marker is gone.
if ARGV[4] == '1' and redis.call('EXISTS', KEYS[3]) == 0 then
  return {2}
end
local owner = redis.call('HGET', KEYS[1], 'o')
if owner == false then
  -- The token is max(last + 1, server time in us). The high-water mark is
  -- shared by many keys, so every key's tokens grow strictly while it lives;
  -- the clock keeps them growing when it is lost in a restart, lags on a
  -- promoted replica or is deleted, as long as the server clock does not
  -- step back. SET ... GET writes the common case (the clock is ahead) and
  -- reads the last token in one call.
  local t = redis.call('TIME')
  local token = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local last = tonumber(redis.call('SET', KEYS[2], string.format('%d', token), 'GET') or '0')
  if last >= token then
    token = last + 1
    redis.call('SET', KEYS[2], string.format('%d', token))
  end
  if ARGV[3] == '1' then
    redis.call('HSET', KEYS[1], 'o', ARGV[1], 'f', string.format('%d', token), 'w', 1)
  else
    redis.call('HSET', KEYS[1], 'o', ARGV[1], 'f', string.format('%d', token))
  end
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1, token, 1}
end
if owner == ARGV[1] then
  local holds = redis.call('HINCRBY', KEYS[1], 'n', 1) + 1
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1, tonumber(redis.call('HGET', KEYS[1], 'f')), holds}
end
if ARGV[3] == '1' then
  -- Asks the holder's release to announce itself; releases nobody waits for
  -- skip the PUBLISH.
  redis.call('HSET', KEYS[1], 'w', 1)
end
return {0, redis.call('PTTL', KEYS[1])}
