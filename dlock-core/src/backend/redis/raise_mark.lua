-- RedLock's write-back (clock.lua is prepended): raises a node's high-water
-- mark (KEYS[1]) to a token a quorum granted (ARGV[1]), never lowers it.
if not at_least(redis.call('GET', KEYS[1]) or '0', ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[1])
end
return 1
