-- A key record is one string: `state|fingerprint|owner|lease end|bucket|bytes|response`,
-- state `p` claimed (owner, lease end in ms of this server's clock) or `c`
-- completed (response), bucket and bytes as its pools count it.
local function parse(v)
  local st, fp, owner, lease, bucket, bytes, at = string.match(v, '^(%a)|([^|]*)|([^|]*)|(%d+)|(%d+)|(%d+)|()')
  return {st = st, fp = fp, owner = owner, lease = tonumber(lease), bucket = bucket, bytes = tonumber(bytes), at = at}
end

local function encode(st, fp, owner, lease, bucket, bytes, response)
  return st .. '|' .. fp .. '|' .. owner .. '|' .. lease .. '|' .. bucket .. '|' .. bytes .. '|' .. response
end
