-- KEYS[1] the fresh token, KEYS[2] its claimed name (one slot: hash tags).
-- Replies 1 claimed (renamed, TTL kept), 2 already claimed, 0 unknown.
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('RENAME', KEYS[1], KEYS[2])
  return 1
end
if redis.call('EXISTS', KEYS[2]) == 1 then
  return 2
end
return 0
