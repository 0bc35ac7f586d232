-- Stores the answer of p_owner's claim of (scope, key): 1 stored; 0 the
-- claim is no longer p_owner's; 5 the answer's bytes do not fit the
-- caller's byte cap, 6 the store's (nothing stored, the claim stays),
-- retry ms until the oldest record (of the caller, of everyone) expires.
-- A claim inside a route's transaction is not in the tally yet: its bytes
-- enter with it, after the commit (enter.sql).
CREATE OR REPLACE FUNCTION {complete}(p_scope text, p_key text, p_owner text, p_response bytea,
                                      p_max_bytes_per_scope bigint, p_max_bytes bigint)
RETURNS TABLE (r_outcome int, r_retry_ms bigint)
LANGUAGE plpgsql VOLATILE AS $dlock_body$
DECLARE
  t_now timestamptz := clock_timestamp();
  rec record;
  v_used bigint;
  v_all bigint;
  v_gone bigint;
  v_oldest timestamptz;
  v_size bigint := octet_length(p_response);
  v_pool text := 'k:' || p_scope;
BEGIN
  SELECT k.counted, k.carried INTO rec FROM {keys} AS k
    WHERE k.scope = p_scope AND k.key = p_key AND k.owner = p_owner AND k.response IS NULL
    FOR UPDATE;
  IF NOT FOUND THEN
    RETURN QUERY SELECT 0, 0::bigint;
    RETURN;
  END IF;
  SELECT coalesce(sum(t.bytes) FILTER (WHERE t.pool = v_pool), 0), coalesce(sum(t.bytes) FILTER (WHERE t.pool = 'k'), 0)
    INTO v_used, v_all FROM {tally} AS t WHERE t.pool IN (v_pool, 'k');
  IF v_used - rec.carried + v_size > p_max_bytes_per_scope THEN
    SELECT coalesce(sum(k.bytes), 0), min(k.expires_at) INTO v_used, v_oldest
      FROM {keys} AS k WHERE k.scope = p_scope AND k.expires_at > t_now;
    IF v_used + v_size > p_max_bytes_per_scope THEN
      RETURN QUERY SELECT 5, greatest(1, ceil(extract(epoch FROM v_oldest - t_now) * 1000))::bigint;
      RETURN;
    END IF;
  END IF;
  IF v_all - rec.carried + v_size > p_max_bytes THEN
    -- The total may count answers of records that expired: discounted.
    SELECT coalesce(sum(CASE WHEN k.counted THEN k.bytes ELSE k.carried END), 0) INTO v_gone
      FROM {keys} AS k WHERE k.expires_at <= t_now;
    IF v_all - v_gone - rec.carried + v_size > p_max_bytes THEN
      SELECT min(k.expires_at) INTO v_oldest FROM {keys} AS k WHERE k.expires_at > t_now;
      RETURN QUERY SELECT 6, greatest(1, ceil(extract(epoch FROM coalesce(v_oldest, t_now) - t_now) * 1000))::bigint;
      RETURN;
    END IF;
  END IF;
  UPDATE {keys} AS k SET owner = NULL, lease_until = NULL, response = p_response, bytes = v_size
    WHERE k.scope = p_scope AND k.key = p_key;
  IF rec.counted AND v_size <> 0 THEN
    PERFORM {tally_add}(ARRAY[v_pool], ARRAY[hashtext(p_key) & 15], ARRAY[0::bigint], ARRAY[v_size]);
  END IF;
  RETURN QUERY SELECT 1, 0::bigint;
END
$dlock_body$;

-- Enters the records claimed and committed inside routes' transactions
-- since the last call in their callers' tallies (at most 1000), in place
-- of what expired rows they overwrote still had there; never waits for a
-- row a running transaction holds, never counts one twice (a row is
-- entered by the one call that locks it). Every instance calls it every
-- second. Returns how many it entered.
CREATE OR REPLACE FUNCTION {enter}()
RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $dlock_body$
DECLARE
  v_entered bigint;
  d_pools text[];
  d_shards int[];
  d_records bigint[];
  d_bytes bigint[];
BEGIN
  WITH pending AS (
    SELECT k.ctid FROM {keys} AS k WHERE NOT k.counted LIMIT 1000 FOR UPDATE SKIP LOCKED
  ), entered AS (
    UPDATE {keys} AS k SET counted = true FROM pending AS p WHERE k.ctid = p.ctid AND NOT k.counted
      RETURNING k.scope, k.key, k.bytes, k.carried_records, k.carried
  )
  SELECT count(*), array_agg('k:' || e.scope), array_agg(hashtext(e.key) & 15),
         array_agg((1 - e.carried_records)::bigint), array_agg(e.bytes - e.carried)
    INTO v_entered, d_pools, d_shards, d_records, d_bytes FROM entered AS e;
  IF v_entered > 0 THEN
    PERFORM {tally_add}(d_pools, d_shards, d_records, d_bytes);
  END IF;
  RETURN v_entered;
END
$dlock_body$;

-- Frees p_owner's claim of (scope, key), so that a retry runs: true when
-- it was p_owner's. It waits for the key's advisory lock, so a claim whose
-- answer was lost, still running on the server, is freed after it.
CREATE OR REPLACE FUNCTION {abandon}(p_scope text, p_key text, p_owner text)
RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $dlock_body$
DECLARE
  gone record;
BEGIN
  PERFORM pg_advisory_xact_lock({class}, hashtext(p_scope || chr(31) || p_key));
  DELETE FROM {keys} AS k
    WHERE k.scope = p_scope AND k.key = p_key AND k.owner = p_owner AND k.response IS NULL
      AND k.expires_at > clock_timestamp()
    RETURNING k.counted, k.bytes INTO gone;
  IF NOT FOUND THEN
    RETURN false;
  END IF;
  IF gone.counted THEN
    PERFORM {tally_add}(ARRAY['k:' || p_scope], ARRAY[hashtext(p_key) & 15], ARRAY[-1::bigint], ARRAY[-gone.bytes]);
  END IF;
  RETURN true;
END
$dlock_body$;

-- Deletes records that expired by p_cut, at most 1000, never waiting for
-- a row a running transaction holds: those of one caller (p_scope), or of
-- everyone (NULL). Returns what to take out of the callers' tallies, by
-- pool and shard (negative), for the caller to apply ({tally_add}) with
-- whatever else it changes there.
CREATE OR REPLACE FUNCTION {expired}(p_scope text, p_cut timestamptz)
RETURNS TABLE (r_pool text, r_shard int, r_records bigint, r_bytes bigint)
LANGUAGE plpgsql VOLATILE AS $dlock_body$
BEGIN
  RETURN QUERY
    WITH doomed AS (
      SELECT k.ctid FROM {keys} AS k
        WHERE k.scope = p_scope AND k.expires_at <= p_cut LIMIT 1000 FOR UPDATE SKIP LOCKED
    ), everyone AS (
      SELECT k.ctid FROM {keys} AS k
        WHERE p_scope IS NULL AND k.expires_at <= p_cut LIMIT 1000 FOR UPDATE SKIP LOCKED
    ), gone AS (
      DELETE FROM {keys} AS k
        WHERE k.ctid = ANY(ARRAY(SELECT ctid FROM doomed UNION ALL SELECT ctid FROM everyone))
        RETURNING k.scope, k.key,
          CASE WHEN k.counted THEN 1 ELSE k.carried_records END AS n,
          CASE WHEN k.counted THEN k.bytes ELSE k.carried END AS bytes
    )
    SELECT 'k:' || g.scope, hashtext(g.key) & 15, -sum(g.n)::bigint, -sum(g.bytes)::bigint
      FROM gone AS g WHERE g.n > 0 OR g.bytes <> 0 GROUP BY 1, 2;
END
$dlock_body$;

-- Deletes records (and, p_scope NULL, tokens) that expired over p_grace_ms
-- ago and takes them out of their tallies, at most 1000 of each, never
-- waiting for a row a running transaction holds: those of one caller
-- (p_scope), or of everyone (NULL). Returns how many records and tokens
-- it took out of the tallies.
CREATE OR REPLACE FUNCTION {sweep}(p_scope text, p_grace_ms bigint)
RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $dlock_body$
DECLARE
  t_cut timestamptz := clock_timestamp() - p_grace_ms * interval '1 millisecond';
  d_pools text[];
  d_shards int[];
  d_records bigint[];
  d_bytes bigint[];
BEGIN
  SELECT array_agg(x.r_pool), array_agg(x.r_shard), array_agg(x.r_records), array_agg(x.r_bytes)
    INTO d_pools, d_shards, d_records, d_bytes FROM {expired}(p_scope, t_cut) AS x;
  IF p_scope IS NULL THEN
    SELECT coalesce(d_pools, '{}') || coalesce(array_agg(x.r_pool), '{}'),
           coalesce(d_shards, '{}') || coalesce(array_agg(x.r_shard), '{}'),
           coalesce(d_records, '{}') || coalesce(array_agg(x.r_records), '{}'),
           coalesce(d_bytes, '{}') || coalesce(array_agg(x.r_bytes), '{}')
      INTO d_pools, d_shards, d_records, d_bytes FROM {expired_tokens}(NULL, t_cut) AS x;
  END IF;
  IF cardinality(d_pools) > 0 THEN
    PERFORM {tally_add}(d_pools, d_shards, d_records, d_bytes);
  END IF;
  RETURN -coalesce((SELECT sum(n) FROM unnest(d_records) AS n), 0);
END
$dlock_body$;
