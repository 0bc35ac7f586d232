-- KEYS[1] record, KEYS[2..] the sets that count it; ARGV[1] owner,
-- ARGV[2] member. Deletes only our own in-progress record.
if redis.call('HGET', KEYS[1], 's') ~= 'p' or redis.call('HGET', KEYS[1], 'o') ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
uncount(2, ARGV[2])
return 1
