-- The first try of a claim inside the route's transaction (begin_in): a
-- new record of a key nobody holds, under its caller's cap and the
-- store's total, as one plain statement instead of a call of {begin},
-- whose PL/pgSQL costs more than the work on this path. It takes what
-- {begin} takes (the key's advisory lock, the transaction's idle timeout)
-- and writes the row {begin} writes for a new record. No row back (the
-- key is claimed, has a record, live or expired, or the caller's tally or
-- the total is at its cap) sends the claim to {begin}, which answers each
-- of those; the advisory lock it may already hold is taken again there.
-- The tally is read, never locked or written (no row of it stays locked
-- while the route runs or commits): the caller's pool and the total, once
-- here for both caps. The row back carries the bytes they held: the
-- answer's first try (complete_in_tx) checks its size against them
-- instead of reading the tally again (records of transactions in flight
-- enter the tally after their commit either way).
-- {durable} makes the route's transaction commit durably whatever the
-- server's synchronous_commit (durable.rs): an answer committed, then
-- forgotten by a crash, would run the route again on a retry. A claim
-- that goes on to {begin} is pinned by that call too.
-- $1 scope, $2 key, $3 fingerprint, $4 owner, $5 lease ms, $6 ttl ms,
-- $7 the caller's cap of records, $8 the store's.
WITH tally AS (
  SELECT coalesce(sum(t.records) FILTER (WHERE t.pool = 'k:' || $1::text), 0) AS records,
         coalesce(sum(t.bytes) FILTER (WHERE t.pool = 'k:' || $1::text), 0)::bigint AS bytes,
         coalesce(sum(t.records) FILTER (WHERE t.pool = 'k'), 0) AS all_records,
         coalesce(sum(t.bytes) FILTER (WHERE t.pool = 'k'), 0)::bigint AS all_bytes
    FROM {tally} AS t WHERE t.pool IN ('k:' || $1::text, 'k')
)
INSERT INTO {keys} (scope, key, fingerprint, owner, lease_until, response, bytes, expires_at, counted, claimed_at)
  SELECT $1, $2, $3, $4, NULL, NULL, 0, clock_timestamp() + $6::bigint * interval '1 millisecond', false,
         clock_timestamp()
    FROM tally
    WHERE set_config('idle_in_transaction_session_timeout', $5::bigint::text, true) IS NOT NULL
      AND {durable} IS NOT NULL
      AND pg_try_advisory_xact_lock({class}, hashtext($1::text || chr(31) || $2::text))
      AND tally.records < $7::bigint AND tally.all_records < $8::bigint
  ON CONFLICT (scope, key) DO NOTHING
  RETURNING 0::int AS r_outcome, NULL::bytea AS r_response, 0::bigint AS r_retry_ms,
    (SELECT tally.bytes FROM tally) AS r_tally_bytes, (SELECT tally.all_bytes FROM tally) AS r_total_bytes
