-- KEYS[1] the fresh token, KEYS[2] its claimed name (one slot: hash tags);
-- ARGV[1] owner, ARGV[2] lease ms. A claimed token's value is
-- `<owner>:<lease end, ms of this server's clock>:<bucket>`; it keeps the
-- TTL. Replies 1 claimed, 2 claimed by a request whose lease has not run
-- out, 3 claimed by one whose lease ran out (its outcome is unknown),
-- 0 unknown.
local now = now_ms()
local fresh = redis.call('GET', KEYS[1])
if fresh then
  redis.call('RENAME', KEYS[1], KEYS[2])
  redis.call('SET', KEYS[2], ARGV[1] .. ':' .. (now + tonumber(ARGV[2])) .. ':' .. fresh, 'KEEPTTL')
  return 1
end
local held = redis.call('GET', KEYS[2])
if not held then
  return 0
end
local ends = tonumber(string.match(held, '^[^:]*:(%d+):'))
if ends and ends > now then
  return 2
end
return 3
