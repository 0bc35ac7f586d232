-- Prepended to acquire.lua and acquire_many.lua (see mod.rs): what each
-- acquire does to its one lock, written once.
-- A lock is a string '<token>:<w>:<owner>' whose TTL is the lease; `w` is
-- '1' when someone waits for its release, else '0'.
-- take(key, token, w, owner, lease ms) takes the lock with `token`, or
-- joins the hold `owner` has already (same token, the lease extended,
-- never shortened), or finds it held by another. With `w` = '1' the lock is
-- marked awaited, held or granted (a winning waiter may have others parked
-- behind it in its process, which only its release will wake; an acquire
-- that found it held asks the holder's release to announce itself, and
-- releases nobody waits for skip the PUBLISH).
-- Returns 1, token (granted) | 2, its token (joined) | 0, the holder's
-- remaining ms (held).
local function take(key, token, w, owner, lease)
  local held = redis.call('SET', key, token .. ':' .. w .. ':' .. owner, 'NX', 'PX', lease, 'GET')
  if not held then
    return 1, token
  end
  local fence, waited, holder = string.match(held, '^(%d+):([01]):(.*)$')
  local joins = holder == owner
  if joins and redis.call('PTTL', key) < tonumber(lease) then
    redis.call('PEXPIRE', key, lease)
  end
  if w == '1' and waited == '0' then
    redis.call('SET', key, fence .. ':1:' .. holder, 'KEEPTTL')
  end
  if joins then
    return 2, fence
  end
  return 0, redis.call('PTTL', key)
end

