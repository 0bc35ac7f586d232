-- Prepended to acquire.lua and acquire_many.lua after counted.lua (see
-- mod.rs): what each acquire does to its one lock, written once.
-- An exclusive lock is a string '<token>:<w>:<owner>' whose TTL is the
-- lease; `w` is '1' when a writer waits for its release, '2' when a reader
-- or a permit does (its release wakes every waiter, not one), else '0'.
-- A shared hold or a permit lives in a hash (counted.lua).
-- take(key, token, w, owner, lease ms, mode, wait ms) takes the lock with
-- `token`, or joins the hold `owner` has already (same token, the lease
-- extended, never shortened), or finds it held by others. `mode` is 'x'
-- exclusive, 's' shared or 'p<N>' one of N permits; `wait` is how long a
-- waiting writer may still wait, which bounds the intent it records.
-- With `w` = '1' the lock is marked awaited, held or granted (a winning
-- waiter may have others parked behind it in its process, which only its
-- release will wake; an acquire that found it held asks the holder's
-- release to announce itself, and releases nobody waits for skip the
-- PUBLISH).
-- Returns 1, token (granted) | 2, its token (joined) | 0, ms until a
-- holder's lease may end (held) | 3, the mode it is held in (-1 exclusive,
-- 0 shared, N permits), which does not fit `mode` (a mistake of the caller).

-- Exclusive lock `key` = `held` found by an acquire of `owner`: joined,
-- conflicting (this owner holds it exclusive and asks for a permit), or
-- held, marked awaited with `mark` when that is news.
local function held_string(key, held, mark, owner, lease, mode)
  local fence, waited, holder = string.match(held, '^(%d+):([012]):(.*)$')
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

-- take() for a key that is counted (a hash), or is asked for in a counted
-- mode: the rare path.
local function take_counted(key, token, w, owner, lease, mode, wait)
  local now = now_ms()
  local at = now + tonumber(lease)
  local kind = redis.call('TYPE', key)['ok']
  if kind == 'string' then
    return held_string(key, redis.call('GET', key), w == '1' and '2' or '0', owner, lease, mode)
  end
  local s = {n = 0, last = 0, intent_at = 0, holders = {}}
  if kind == 'hash' then
    s = live(key, now)
    -- Nobody holds it (and no writer keeps readers out): free for any mode.
    if s.n == 0 and (mode ~= 's' or not s.intent) then
      redis.call('DEL', key)
      kind = 'none'
    end
  end
  -- Someone waited for the counted key: the next holder's release announces.
  local waited = w == '1' or s.w == '1'
  if kind == 'none' then
    if mode == 'x' then
      -- Readers may wait among them, so its release must wake them all.
      redis.call('SET', key, token .. ':' .. (waited and '2' or '0') .. ':' .. owner, 'PX', lease)
    else
      redis.call('HSET', key, 'm', mode, owner, string.format('%s:%d', token, at), 'w', waited and '1' or '0')
      redis.call('PEXPIREAT', key, at)
    end
    return 1, token
  end
  local held = s.mode == 's' and 0 or tonumber(string.sub(s.mode, 2))
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
    return refused(s.first - now)
  end
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
  if mode == 'x' then
    local held = redis.pcall('SET', key, token .. ':' .. w .. ':' .. owner, 'NX', 'PX', lease, 'GET')
    if not held then
      return 1, token
    end
    if not wrong_type(held) then
      return held_string(key, held, w, owner, lease, mode)
    end
  end
  return take_counted(key, token, w, owner, lease, mode, wait)
end
