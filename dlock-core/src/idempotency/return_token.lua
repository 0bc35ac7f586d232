-- KEYS[1] the claimed token, KEYS[2] its fresh name (one slot: hash tags).
-- Replies 1 when given back (renamed, TTL kept), 0 when no longer claimed.
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('RENAME', KEYS[1], KEYS[2])
  return 1
end
return 0
