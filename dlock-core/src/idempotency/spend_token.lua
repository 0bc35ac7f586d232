-- KEYS[1] the token's name (fresh to consume, claimed to spend), KEYS[2..]
-- the sets that count it; ARGV[1] member, ARGV[2] the claim's owner ('' to
-- consume a fresh token). One DEL: only the caller whose DEL counted 1
-- proceeds.
if ARGV[2] ~= '' then
  local held = redis.call('GET', KEYS[1])
  if not held or string.match(held, '^([^:]*):') ~= ARGV[2] then
    return 0
  end
end
if redis.call('DEL', KEYS[1]) == 1 then
  uncount(2, ARGV[1])
  return 1
end
return 0
