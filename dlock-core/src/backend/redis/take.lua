-- Prepended to acquire.lua and acquire_many.lua after counted.lua (see
-- mod.rs): what each acquire does to its one lock, written once.
-- A lock with one holder is a string '<token>:<flag>:<owner>' whose TTL is
-- the lease. For an exclusive hold `flag` is one byte: '1' when a writer
-- waits for its release, '2' when a reader or a permit does (its release
-- wakes every waiter, not one), else '0'. A shared hold or a permit held
-- alone has a longer flag, '<w><mode>' ('0s', '1p3': `w` '1' once someone
-- waited), so an uncontended read lock or permit costs what an exclusive
-- lock does; a second holder turns the key into a hash (counted.lua).
-- take(key, token, w, owner, lease ms, mode, wait ms) takes the lock with
-- `token`, or joins the hold `owner` has already (same token, the lease
-- extended, never shortened), or finds it held by others. `mode` is 'x'
-- exclusive, 's' shared or 'p<N>' one of N permits; `wait` is how long a
-- waiting writer or permit may still wait, which bounds the intent or the
-- place it records.
-- With `w` = '1' the lock is marked awaited, held or granted (a winning
-- waiter may have others parked behind it in its process, which only its
-- release will wake; an acquire that found it held asks the holder's
-- release to announce itself, and releases nobody waits for skip the
-- PUBLISH).
-- Returns 1, token (granted) | 2, its token (joined) | 0, ms until a
-- holder's lease may end (held) | 3, the mode it is held in (-1 exclusive,
-- 0 shared, N permits), which does not fit `mode` (a mistake of the caller).

-- The code `take` returns for counted mode `m` ('s' or 'p<N>').
local function mode_code(m)
  return m == 's' and 0 or tonumber(string.sub(m, 2))
end

-- Exclusive lock `key` = `held` found by an acquire of `owner`: joined,
-- conflicting (this owner holds it exclusive and asks for a permit), or
-- held, marked awaited with `mark` when that is news.
local function held_string(key, fence, waited, holder, mark, owner, lease, mode)
  local joins = holder == owner
  if joins then
    if string.byte(mode, 1) == 112 then
      return 3, -1
    end
    if redis.call('PTTL', key) < tonumber(lease) then
      redis.call('PEXPIRE', key, lease)
    end
  end
  if mark > waited then
    redis.call('SET', key, fence .. ':' .. mark .. ':' .. holder, 'KEEPTTL')
  end
  if joins then
    return 2, fence
  end
  return 0, redis.call('PTTL', key)
end

-- A string lock `key` held by `holder` alone as `flag` ('<w><mode>'),
-- found by an acquire of `owner` in `mode`: joined, refused, a conflict,
-- or (a second reader, a second permit) the key becomes a hash of both
-- holders. A writer that waits turns it into a hash too, to record the
-- intent that keeps new readers out, and so does a permit that waits for
-- the one permit, to record its place (counted.lua).
local function held_alone(key, fence, flag, holder, token, w, owner, lease, mode, wait)
  local m, waited = string.sub(flag, 2), string.sub(flag, 1, 1)
  if holder == owner and mode == m then
    if redis.call('PTTL', key) < tonumber(lease) then
      redis.call('PEXPIRE', key, lease)
    end
    return 2, fence
  end
  if mode ~= m and (mode ~= 'x' or m ~= 's') then
    return 3, mode_code(m)
  end
  local grants = mode ~= 'x' and holder ~= owner and m ~= 'p1'
  local waits = not grants and w == '1' and tonumber(wait) > 0
  if not grants and not waits then
    if w == '1' and waited ~= '1' then
      redis.call('SET', key, fence .. ':1' .. m .. ':' .. holder, 'KEEPTTL')
    end
    return 0, redis.call('PTTL', key)
  end
  local now = now_ms()
  local first = now + redis.call('PTTL', key)
  local aw = (w == '1' or waited == '1') and '1' or '0'
  redis.call('DEL', key)
  if grants then
    local at = now + tonumber(lease)
    redis.call('HSET', key, 'm', m, 'w', aw, holder, string.format('%s:%d', fence, first), owner,
      string.format('%s:%d', token, at))
    redis.call('PEXPIREAT', key, math.max(first, at))
    return 1, token
  end
  local until_at = now + tonumber(wait)
  local field, value = 'i', string.format('%d:%s', until_at, owner)
  if mode ~= 'x' then
    field, value = '~' .. owner, string.format('%d', until_at)
  end
  redis.call('HSET', key, 'm', m, 'w', aw, holder, string.format('%s:%d', fence, first), field, value)
  redis.call('PEXPIREAT', key, math.max(first, until_at))
  return 0, first - now
end

-- A string lock `key` = `held` found by an acquire: an exclusive holder
-- or one holding a shared lock or permit alone.
local function held_by_string(key, held, token, w, owner, lease, mode, wait)
  local fence, flag, holder = string.match(held, '^(%d+):([^:]+):(.*)$')
  if #flag > 1 then
    return held_alone(key, fence, flag, holder, token, w, owner, lease, mode, wait)
  end
  -- Readers or permits wait among the waiters: the release wakes them all.
  local mark = w == '1' and (mode == 'x' and '1' or '2') or '0'
  return held_string(key, fence, flag, holder, mark, owner, lease, mode)
end

-- take() for a key that is a hash (counted.lua): the contended path of
-- shared holds and permits.
local function take_hash(key, token, w, owner, lease, mode, wait)
  local now = now_ms()
  local at = now + tonumber(lease)
  local s = live(key, now)
  -- Nobody holds it, and nobody waits in a way that fixes its mode: free
  -- for any mode, and held by one, so a string again. A writer's intent
  -- keeps it a read-write key (readers wait behind it, and permits do not
  -- fit), a waiting permit's place a semaphore of its limit.
  if s.n == 0 and s.waits_until == 0 and (mode == 'x' or not s.intent) then
    redis.call('DEL', key)
    local waited = (w == '1' or s.w == '1') and '1' or '0'
    local flag = mode == 'x' and (waited == '1' and '2' or '0') or waited .. mode
    redis.call('SET', key, token .. ':' .. flag .. ':' .. owner, 'PX', lease)
    return 1, token
  end
  local held = mode_code(s.mode)
  local function refused(ms)
    if w == '1' and s.w ~= '1' then
      redis.call('HSET', key, 'w', '1')
    end
    return 0, math.max(ms, 0)
  end
  if mode == 'x' then
    if held ~= 0 then
      return 3, held
    end
    -- A writer waits for the readers. One that waits records (or renews)
    -- its intent, which new readers wait behind, until its wait ends.
    if w == '1' and tonumber(wait) > 0 and (not s.intent or s.intent == owner) then
      s.intent_at = now + tonumber(wait)
      redis.call('HSET', key, 'i', string.format('%d:%s', s.intent_at, owner))
      keep_until(key, s)
    end
    return refused(s.first - now)
  end
  if mode ~= s.mode then
    return 3, held
  end
  local mine = s.holders[owner]
  if mine then
    if at > mine[2] then
      redis.call('HSET', key, owner, string.format('%s:%d', mine[1], at))
      s.last = math.max(s.last, at)
      keep_until(key, s)
    end
    return 2, mine[1]
  end
  if held == 0 and s.intent and s.intent ~= owner then
    return refused(s.intent_at - now)
  end
  if held > 0 and s.n >= held then
    -- A permit that waits keeps its place, and with it the key's limit,
    -- until its wait ends (or it is granted, or withdraws it: free.lua).
    if w == '1' and tonumber(wait) > 0 then
      local until_at = now + tonumber(wait)
      redis.call('HSET', key, '~' .. owner, string.format('%d', until_at))
      s.waits_until = math.max(s.waits_until, until_at)
      keep_until(key, s)
    end
    return refused(s.first - now)
  end
  unqueue(key, s, owner)
  if w == '1' and s.w ~= '1' then
    redis.call('HSET', key, owner, string.format('%s:%d', token, at), 'w', '1')
  else
    redis.call('HSET', key, owner, string.format('%s:%d', token, at))
  end
  s.last = math.max(s.last, at)
  keep_until(key, s)
  return 1, token
end

local function take(key, token, w, owner, lease, mode, wait)
  local flag = mode == 'x' and w or w .. mode
  local held = redis.pcall('SET', key, token .. ':' .. flag .. ':' .. owner, 'NX', 'PX', lease, 'GET')
  if not held then
    return 1, token
  end
  if wrong_type(held) then
    return take_hash(key, token, w, owner, lease, mode, wait)
  end
  return held_by_string(key, held, token, w, owner, lease, mode, wait)
end
