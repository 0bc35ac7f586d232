-- KEYS[1] record; ARGV[1] owner. Deletes only our own in-progress record.
if redis.call('HGET', KEYS[1], 's') ~= 'p' or redis.call('HGET', KEYS[1], 'o') ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
return 1
