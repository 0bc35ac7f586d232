-- A key record is one string: `state|fingerprint|owner|lease end|bucket|bytes|tail`,
-- state `p` claimed (owner, lease end in ms of this server's clock) or `c`
-- completed, bucket and bytes as its pools count it. A completed record's
-- tail is its response; a claim's is what an operator is shown of it,
-- `<claimed at, ms of this server's clock>:<scope's length>:<scope><key>`
-- (empty in a claim of an earlier version, which no script reads).
local function parse(v)
  local st, fp, owner, lease, bucket, bytes, at = string.match(v, '^(%a)|([^|]*)|([^|]*)|(%d+)|(%d+)|(%d+)|()')
  return {st = st, fp = fp, owner = owner, lease = tonumber(lease), bucket = bucket, bytes = tonumber(bytes), at = at}
end

local function encode(st, fp, owner, lease, bucket, bytes, response)
  return st .. '|' .. fp .. '|' .. owner .. '|' .. lease .. '|' .. bucket .. '|' .. bytes .. '|' .. response
end
