-- The tally pool of a token bound to p_principal (NULL: unbound).
CREATE OR REPLACE FUNCTION {token_pool}(p_principal text)
RETURNS text
LANGUAGE sql IMMUTABLE AS $dlock_body$
  SELECT CASE WHEN p_principal IS NULL THEN 'u' ELSE 't:' || p_principal END
$dlock_body$;

-- Deletes tokens that expired by p_cut, at most 1000, never waiting for a
-- row a running transaction holds: those of one pool (p_pool, as
-- {token_pool} names it), or of every pool (NULL). Returns what to take
-- out of their tallies, by pool and shard (negative), for the caller to
-- apply ({tally_add}) with whatever else it changes there.
CREATE OR REPLACE FUNCTION {expired_tokens}(p_pool text, p_cut timestamptz)
RETURNS TABLE (r_pool text, r_shard int, r_records bigint, r_bytes bigint)
LANGUAGE plpgsql VOLATILE AS $dlock_body$
BEGIN
  RETURN QUERY
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
    )
    SELECT {token_pool}(g.principal), hashtext(g.token) & 15, -count(*), 0::bigint
      FROM gone AS g GROUP BY 1, 2;
END
$dlock_body$;

-- Issues p_token, bound to p_principal (NULL: unbound), for p_ttl_ms.
-- Returns one row (outcome, retry ms): 0 issued; 5 its pool (the
-- principal's tokens, or all unbound ones) holds p_max already, 6 the
-- bound tokens of every principal hold p_max_bound already, the oldest
-- of them expires in retry ms.
CREATE OR REPLACE FUNCTION {issue}(p_token text, p_principal text, p_ttl_ms bigint, p_max bigint,
                                   p_max_bound bigint)
RETURNS TABLE (r_outcome int, r_retry_ms bigint)
LANGUAGE plpgsql VOLATILE AS $dlock_body$
DECLARE
  t_now timestamptz;
  v_pool text := {token_pool}(p_principal);
  v_shard int := hashtext(p_token) & 15;
  v_live bigint;
  v_all bigint;
  v_gone bigint;
  v_oldest timestamptz;
  v_outcome int := 0;
  -- What this changes in the tally, applied at its end in one call.
  d_pools text[] := '{}';
  d_shards int[] := '{}';
  d_records bigint[] := '{}';
  d_bytes bigint[] := '{}';
BEGIN
  -- Issues to one pool one at a time, so its cap holds exactly.
  PERFORM pg_advisory_xact_lock({class} + 2, hashtext(v_pool));
  t_now := clock_timestamp();
  SELECT coalesce(sum(t.records) FILTER (WHERE t.pool = v_pool), 0), coalesce(sum(t.records) FILTER (WHERE t.pool = 't'), 0)
    INTO v_live, v_all FROM {tally} AS t WHERE t.pool IN (v_pool, 't');
  IF v_live >= p_max THEN
    -- The tally may count tokens that expired: sweep them, count exactly.
    SELECT coalesce(array_agg(x.r_pool), '{}'), coalesce(array_agg(x.r_shard), '{}'),
           coalesce(array_agg(x.r_records), '{}'), coalesce(array_agg(x.r_bytes), '{}')
      INTO d_pools, d_shards, d_records, d_bytes FROM {expired_tokens}(v_pool, t_now) AS x;
    IF p_principal IS NULL THEN
      SELECT count(*), min(t.expires_at) INTO v_live, v_oldest FROM {tokens} AS t
        WHERE t.principal IS NULL AND t.expires_at > t_now;
    ELSE
      -- Swept here, out of the total once applied.
      v_all := v_all + coalesce((SELECT sum(n) FROM unnest(d_records) AS n), 0);
      SELECT count(*), min(t.expires_at) INTO v_live, v_oldest FROM {tokens} AS t
        WHERE t.principal = p_principal AND t.expires_at > t_now;
    END IF;
    IF v_live >= p_max THEN
      v_outcome := 5;
    END IF;
  END IF;
  IF v_outcome = 0 AND p_principal IS NOT NULL AND v_all >= p_max_bound THEN
    -- The total may count bound tokens that expired: discounted.
    SELECT count(*) INTO v_gone FROM {tokens} AS t WHERE t.expires_at <= t_now AND t.principal IS NOT NULL;
    IF v_all - v_gone >= p_max_bound THEN
      v_outcome := 6;
      SELECT min(t.expires_at) INTO v_oldest FROM {tokens} AS t
        WHERE t.expires_at > t_now AND t.principal IS NOT NULL;
    END IF;
  END IF;
  IF v_outcome = 0 THEN
    INSERT INTO {tokens} (token, principal, owner, lease_until, expires_at)
      VALUES (p_token, p_principal, NULL, NULL, t_now + p_ttl_ms * interval '1 millisecond');
    d_pools := d_pools || v_pool;
    d_shards := d_shards || v_shard;
    d_records := d_records || 1::bigint;
    d_bytes := d_bytes || 0::bigint;
  END IF;
  IF cardinality(d_pools) > 0 THEN
    PERFORM {tally_add}(d_pools, d_shards, d_records, d_bytes);
  END IF;
  RETURN QUERY SELECT v_outcome,
    CASE WHEN v_outcome = 0 THEN 0::bigint
         ELSE greatest(1, ceil(extract(epoch FROM coalesce(v_oldest, t_now) - t_now) * 1000))::bigint END;
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
