-- The tally pool of a token bound to p_principal (NULL: unbound).
CREATE OR REPLACE FUNCTION {token_pool}(p_principal text)
RETURNS text
LANGUAGE sql IMMUTABLE AS $dlock_body$
  SELECT CASE WHEN p_principal IS NULL THEN 'u' ELSE 't:' || p_principal END
$dlock_body$;

-- Deletes tokens that expired before p_cut and takes them out of their
-- tallies, at most 1000, never waiting for a row a running transaction
-- holds: those of one pool (p_pool, as {token_pool} names it), or of
-- every pool (NULL). Returns how many went.
CREATE OR REPLACE FUNCTION {sweep_tokens}(p_pool text, p_cut timestamptz)
RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $dlock_body$
DECLARE
  v_gone bigint;
BEGIN
  WITH doomed AS (
    SELECT t.ctid FROM {tokens} AS t
      WHERE p_pool = 'u' AND t.principal IS NULL AND t.expires_at <= p_cut LIMIT 1000 FOR UPDATE SKIP LOCKED
  ), bound AS (
    SELECT t.ctid FROM {tokens} AS t
      WHERE p_pool LIKE 't:%' AND t.principal = substr(p_pool, 3) AND t.expires_at <= p_cut
      LIMIT 1000 FOR UPDATE SKIP LOCKED
  ), everyone AS (
    SELECT t.ctid FROM {tokens} AS t
      WHERE p_pool IS NULL AND t.expires_at <= p_cut LIMIT 1000 FOR UPDATE SKIP LOCKED
  ), gone AS (
    DELETE FROM {tokens} AS t
      WHERE t.ctid = ANY(ARRAY(SELECT ctid FROM doomed UNION ALL SELECT ctid FROM bound
                               UNION ALL SELECT ctid FROM everyone))
      RETURNING t.principal, t.token
  ), shards AS (
    SELECT {token_pool}(g.principal) AS pool, hashtext(g.token) & 15 AS shard, count(*) AS n
      FROM gone AS g GROUP BY 1, 2
  ), counted AS (
    UPDATE {tally} AS t SET records = t.records - s.n FROM shards AS s WHERE t.pool = s.pool AND t.shard = s.shard
  )
  SELECT count(*) INTO v_gone FROM gone;
  RETURN v_gone;
END
$dlock_body$;

-- Issues p_token, bound to p_principal (NULL: unbound), for p_ttl_ms.
-- Returns 0, or the ms until the oldest token of its pool expires when the
-- pool (the principal's tokens, or all unbound ones) holds p_max already.
CREATE OR REPLACE FUNCTION {issue}(p_token text, p_principal text, p_ttl_ms bigint, p_max bigint)
RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $dlock_body$
DECLARE
  t_now timestamptz;
  v_pool text := {token_pool}(p_principal);
  v_live bigint;
  v_oldest timestamptz;
BEGIN
  -- Issues to one pool one at a time, so its cap holds exactly.
  PERFORM pg_advisory_xact_lock({class} + 2, hashtext(v_pool));
  t_now := clock_timestamp();
  SELECT coalesce(sum(t.records), 0) INTO v_live FROM {tally} AS t WHERE t.pool = v_pool;
  IF v_live >= p_max THEN
    -- The tally may count tokens that expired: sweep them, count exactly.
    PERFORM {sweep_tokens}(v_pool, t_now);
    IF p_principal IS NULL THEN
      SELECT count(*), min(t.expires_at) INTO v_live, v_oldest FROM {tokens} AS t
        WHERE t.principal IS NULL AND t.expires_at > t_now;
    ELSE
      SELECT count(*), min(t.expires_at) INTO v_live, v_oldest FROM {tokens} AS t
        WHERE t.principal = p_principal AND t.expires_at > t_now;
    END IF;
    IF v_live >= p_max THEN
      RETURN greatest(1, ceil(extract(epoch FROM v_oldest - t_now) * 1000))::bigint;
    END IF;
  END IF;
  INSERT INTO {tokens} (token, principal, owner, lease_until, expires_at)
    VALUES (p_token, p_principal, NULL, NULL, t_now + p_ttl_ms * interval '1 millisecond');
  INSERT INTO {tally} AS t (pool, shard, records, bytes) VALUES (v_pool, hashtext(p_token) & 15, 1, 0)
    ON CONFLICT (pool, shard) DO UPDATE SET records = t.records + 1;
  RETURN 0;
END
$dlock_body$;

-- Claims p_token for p_owner: 0 claimed; 1 in use by another running
-- request; 2 its claim's lease ran out (outcome unknown, counts as
-- spent); 3 unknown, expired, spent or bound to another principal.
CREATE OR REPLACE FUNCTION {claim}(p_token text, p_principal text, p_owner text, p_lease_ms bigint)
RETURNS int
LANGUAGE plpgsql VOLATILE AS $dlock_body$
DECLARE
  t_now timestamptz;
  tok record;
BEGIN
  SELECT t.principal, t.owner, t.lease_until, t.expires_at INTO tok FROM {tokens} AS t
    WHERE t.token = p_token FOR UPDATE;
  t_now := clock_timestamp();
  IF NOT FOUND OR tok.expires_at <= t_now OR tok.principal IS DISTINCT FROM p_principal THEN
    RETURN 3;
  ELSIF tok.owner IS NOT NULL AND tok.lease_until > t_now THEN
    RETURN 1;
  ELSIF tok.owner IS NOT NULL THEN
    RETURN 2;
  END IF;
  UPDATE {tokens} AS t SET owner = p_owner, lease_until = t_now + p_lease_ms * interval '1 millisecond'
    WHERE t.token = p_token;
  RETURN 0;
END
$dlock_body$;
