-- The first try at storing the answer inside the route's transaction
-- (complete_in): the claim this transaction made with claim_in_tx, not in
-- its caller's tally yet (it enters after the commit, with its bytes), and
-- an answer whose bytes fit the caller's cap and the store's total by the
-- tally as that claim read it, as one plain statement with no read of the
-- tally. No row back sends it to {complete}, which answers the other cases
-- (a claim no longer the owner's, one taken over from a counted record, a
-- tally that must be counted exactly at a cap).
-- {durable}: the route's commit durable, as claim_in_tx.sql pins it.
-- $1 scope, $2 key, $3 owner, $4 the encoded answer, $5 the caller's cap
-- of bytes, $6 the store's, $7 the bytes of the caller's tally and $8 of
-- the total when the claim was made.
UPDATE {keys} AS k SET owner = NULL, lease_until = NULL, response = $4::bytea, bytes = octet_length($4::bytea)
  WHERE k.scope = $1::text AND k.key = $2::text AND k.owner = $3::text AND k.response IS NULL AND NOT k.counted
    AND $7::bigint - k.carried + octet_length($4::bytea) <= $5::bigint
    AND $8::bigint - k.carried + octet_length($4::bytea) <= $6::bigint AND {durable} IS NOT NULL
  RETURNING 1::int AS r_outcome, 0::bigint AS r_retry_ms
