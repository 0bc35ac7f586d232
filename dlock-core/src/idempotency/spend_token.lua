-- KEYS[1] the token's name (fresh to consume, claimed to spend), KEYS[2..]
-- the sets that count it; ARGV[1] member. One DEL: only the caller whose
-- DEL counted 1 proceeds.
if redis.call('DEL', KEYS[1]) == 1 then
  uncount(2, ARGV[1])
  return 1
end
return 0
