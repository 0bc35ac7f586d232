-- KEYS[1] record, KEYS[2..] the sets that count it; ARGV[1] owner,
-- ARGV[2] member. Deletes only our own in-progress record.
local record = redis.call('HMGET', KEYS[1], 's', 'o')
if record[1] ~= 'p' or record[2] ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
uncount(2, ARGV[2])
return 1
