-- Prepended to release.lua and release_many.lua after counted.lua (see
-- mod.rs): what each release does to its one lock, written once.
-- free(key, owner) deletes lock `key` '<token>:<flag>:<owner>' only for its
-- owner, or drops the owner's hold from a counted key (counted.lua), and
-- announces the release on `key:released` when someone waits for it (the
-- channel is release_channel in mod.rs): with the payload 'a' when every
-- waiter may go (readers waited, or a reader left a read-write lock), ''
-- when one may (a permit, an exclusive hold only writers waited for). The
-- lock's fencing token needs no keeping: the high-water mark the acquire
-- advanced is above it. Returns 0 when freed, -1 when not held by this
-- owner.
-- With `only_waits`, free takes back only what the waits of `owner` left
-- (a writer's intent, a waiting permit's place), never a hold: the
-- withdrawal of an acquire that ended without a grant (cancelled, failed)
-- before its wait did. Returns 0 when it took something back, else -1.

-- Takes back what the waits of `owner` left in counted key `s`: its
-- intent, whose end wakes the readers it kept out, and its place. Returns
-- whether there was any.
local function withdraw(key, s, owner)
  local withdrew = unqueue(key, s, owner)
  if s.intent == owner then
    redis.call('HDEL', key, 'i')
    s.intent_at = 0
    withdrew = true
    if s.w == '1' then
      redis.call('PUBLISH', key .. ':released', 'a')
    end
  end
  return withdrew
end

-- free() on a counted key: the rare path.
local function free_counted(key, owner, only_waits)
  local s = live(key, now_ms())
  if only_waits or not s.holders[owner] then
    -- A waiter granted elsewhere (by a RedLock quorum) while this node
    -- refused it leaves its intent or place here: they go with its release.
    local withdrew = withdraw(key, s, owner)
    keep_until(key, s)
    return (only_waits and withdrew) and 0 or -1
  end
  redis.call('HDEL', key, owner)
  s.holders[owner] = nil
  s.last = 0
  for _, h in pairs(s.holders) do
    s.last = math.max(s.last, h[2])
  end
  keep_until(key, s)
  if s.w == '1' then
    redis.call('PUBLISH', key .. ':released', s.mode == 's' and 'a' or '')
  end
  return 0
end

-- free() on a string whose flag is longer than a byte: a shared hold or a
-- permit held alone ('<token>:<w><mode>:<owner>', see take.lua).
local function free_alone(key, lock, owner)
  local _, flag, holder = string.match(lock, '^(%d+):([^:]+):(.*)$')
  if not flag or #flag < 2 or holder ~= owner then
    return -1
  end
  redis.call('DEL', key)
  if string.byte(flag, 1) == 49 then
    redis.call('PUBLISH', key .. ':released', string.sub(flag, 2) == 's' and 'a' or '')
  end
  return 0
end

local function free(key, owner, only_waits)
  local lock = redis.pcall('GET', key)
  if not lock then
    return -1
  end
  if wrong_type(lock) then
    return free_counted(key, owner, only_waits)
  end
  -- A string is held by one holder, and keeps no waiter's intent or place.
  if only_waits then
    return -1
  end
  -- The token is digits only, so the first ':' ends it, `w` follows and the
  -- owner is the rest from two bytes later: plain finds, no pattern, no copy.
  local colon = string.find(lock, ':', 1, true)
  if not colon then
    return -1
  end
  if #lock ~= colon + 2 + #owner or string.find(lock, owner, colon + 3, true) ~= colon + 3 then
    return free_alone(key, lock, owner)
  end
  redis.call('DEL', key)
  local w = string.byte(lock, colon + 1)
  if w ~= 48 then
    redis.call('PUBLISH', key .. ':released', w == 50 and 'a' or '')
  end
  return 0
end
