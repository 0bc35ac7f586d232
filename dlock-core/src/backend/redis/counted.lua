-- Prepended to the acquire, release and renew scripts (see mod.rs): a key
-- held in a mode that admits several holders, written once.
-- Held by one holder, such a key is a string like an exclusive lock (see
-- take.lua), so an uncontended read lock or permit costs what an exclusive
-- lock does. Held by several (or by readers a writer waits for), it is a
-- hash under the lock's own name (same slot): `m` its mode
-- ('s' shared, 'p<N>' one of N permits), `w` '1' once someone waited for
-- it, `i` a waiting writer's intent '<until ms>:<owner>' (new readers wait
-- behind it), one field per holder, its owner (32 hex digits, so never
-- one of those one-letter names) = '<fence>:<until ms>', and one per
-- waiting permit, '~<owner>' = '<until ms>': its place, which keeps the
-- key a semaphore of its limit while it waits, also once nobody holds it.
-- Times are server time. The key expires (PEXPIREAT) with the latest of
-- those; expired holders, intents and places are dropped by whichever
-- operation finds them next.
-- An exclusive lock is a string: a command for strings on a hash fails
-- with WRONGTYPE, which is how the exclusive path learns, at no cost to
-- itself, that it met a counted key.

-- Server time in ms.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- `reply` of a redis.pcall that failed: WRONGTYPE (the key is the other
-- kind of lock) is returned to the caller's rare path, anything else is
-- raised as the error it is.
local function wrong_type(reply)
  if type(reply) == 'table' and reply.err then
    if string.find(reply.err, 'WRONGTYPE', 1, true) then
      return true
    end
    error(reply.err)
  end
  return false
end

-- The live state of counted key `key` at `now`, its expired holders,
-- intent and places deleted: {mode, w, intent (owner), intent_at, n (live
-- holders), holders (owner -> {fence text, until}), first, last (their
-- earliest and latest until), waiting (owner -> until, the places of
-- waiting permits), waits_until (the latest of those, 0 when none)}.
local function live(key, now)
  local flat = redis.call('HGETALL', key)
  local s = {n = 0, holders = {}, intent_at = 0, first = nil, last = 0, waiting = {}, waits_until = 0}
  local dead = {}
  for i = 1, #flat, 2 do
    local f, v = flat[i], flat[i + 1]
    if f == 'm' then
      s.mode = v
    elseif f == 'w' then
      s.w = v
    elseif string.byte(f, 1) == 126 then
      local at = tonumber(v)
      if not at or at <= now then
        dead[#dead + 1] = f
      else
        s.waiting[string.sub(f, 2)] = at
        s.waits_until = math.max(s.waits_until, at)
      end
    else
      local a, b = string.match(v, '^(%d+):(.*)$')
      local at = f == 'i' and tonumber(a) or tonumber(b)
      if not at or at <= now then
        dead[#dead + 1] = f
      elseif f == 'i' then
        s.intent, s.intent_at = b, at
      else
        s.holders[f] = {a, at}
        s.n = s.n + 1
        s.last = math.max(s.last, at)
        s.first = s.first and math.min(s.first, at) or at
      end
    end
  end
  if #dead > 0 then
    redis.call('HDEL', key, unpack(dead))
  end
  return s
end

-- Sets the key's expiry to the latest of its holders, intent and places;
-- deletes it when none is left. Returns whether it is still there.
local function keep_until(key, s)
  local last = math.max(s.last, s.intent_at, s.waits_until)
  if last == 0 then
    redis.call('DEL', key)
    return false
  end
  redis.call('PEXPIREAT', key, last)
  return true
end


-- Drops the place `owner` kept as a waiting permit of counted key `key`,
-- if it has one: it was granted, or gave up. Returns whether it had one.
local function unqueue(key, s, owner)
  if not s.waiting[owner] then
    return false
  end
  redis.call('HDEL', key, '~' .. owner)
  s.waiting[owner] = nil
  s.waits_until = 0
  for _, at in pairs(s.waiting) do
    s.waits_until = math.max(s.waits_until, at)
  end
  return true
end
