-- Stores the answer of p_owner's claim of (scope, key): 1 stored; 0 the
-- claim is no longer p_owner's; 5 the answer's bytes do not fit the
-- caller's byte cap (nothing stored, the claim stays), retry ms until
-- its oldest record expires. A claim inside a route's transaction is not
-- in the tally yet: its bytes enter with it, after the commit (enter.sql).
CREATE OR REPLACE FUNCTION {complete}(p_scope text, p_key text, p_owner text, p_response bytea,
                                      p_max_bytes_per_scope bigint)
RETURNS TABLE (r_outcome int, r_retry_ms bigint)
LANGUAGE plpgsql VOLATILE AS $dlock_body$
DECLARE
  t_now timestamptz := clock_timestamp();
  rec record;
  v_used bigint;
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
  SELECT coalesce(sum(t.bytes), 0) INTO v_used FROM {tally} AS t WHERE t.pool = v_pool;
  IF v_used - rec.carried + v_size > p_max_bytes_per_scope THEN
    SELECT coalesce(sum(k.bytes), 0), min(k.expires_at) INTO v_used, v_oldest
      FROM {keys} AS k WHERE k.scope = p_scope AND k.expires_at > t_now;
    IF v_used + v_size > p_max_bytes_per_scope THEN
      RETURN QUERY SELECT 5, greatest(1, ceil(extract(epoch FROM v_oldest - t_now) * 1000))::bigint;
      RETURN;
    END IF;
  END IF;
  UPDATE {keys} AS k SET owner = NULL, lease_until = NULL, response = p_response, bytes = v_size
    WHERE k.scope = p_scope AND k.key = p_key;
  IF rec.counted AND v_size <> 0 THEN
    UPDATE {tally} AS t SET bytes = t.bytes + v_size
      WHERE t.pool = v_pool AND t.shard = hashtext(p_key) & 15;
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
BEGIN
  WITH pending AS (
    SELECT k.ctid FROM {keys} AS k WHERE NOT k.counted LIMIT 1000 FOR UPDATE SKIP LOCKED
  ), entered AS (
    UPDATE {keys} AS k SET counted = true FROM pending AS p WHERE k.ctid = p.ctid AND NOT k.counted
      RETURNING k.scope, k.key, k.bytes, k.carried_records, k.carried
  ), shards AS (
    SELECT 'k:' || e.scope AS pool, hashtext(e.key) & 15 AS shard, sum(1 - e.carried_records) AS n,
           sum(e.bytes - e.carried) AS b
      FROM entered AS e GROUP BY 1, 2
  ), counted AS (
    INSERT INTO {tally} AS t (pool, shard, records, bytes) SELECT s.pool, s.shard, s.n, s.b FROM shards AS s
      ON CONFLICT (pool, shard) DO UPDATE
        SET records = t.records + EXCLUDED.records, bytes = t.bytes + EXCLUDED.bytes
  )
  SELECT count(*) INTO v_entered FROM entered;
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
    UPDATE {tally} AS t SET records = t.records - 1, bytes = t.bytes - gone.bytes
      WHERE t.pool = 'k:' || p_scope AND t.shard = hashtext(p_key) & 15;
  END IF;
  RETURN true;
END
$dlock_body$;

-- Deletes records and tokens that expired over p_grace_ms ago and takes
-- them out of their tallies, at most 1000 of each, never waiting for a
-- row a running transaction holds: those of one caller (p_scope), or of
-- everyone (NULL). Returns how many went.
CREATE OR REPLACE FUNCTION {sweep}(p_scope text, p_grace_ms bigint)
RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $dlock_body$
DECLARE
  t_cut timestamptz := clock_timestamp() - p_grace_ms * interval '1 millisecond';
  v_keys bigint;
  v_tokens bigint := 0;
BEGIN
  WITH doomed AS (
    SELECT k.ctid FROM {keys} AS k
      WHERE k.scope = p_scope AND k.expires_at <= t_cut LIMIT 1000 FOR UPDATE SKIP LOCKED
  ), everyone AS (
    SELECT k.ctid FROM {keys} AS k
      WHERE p_scope IS NULL AND k.expires_at <= t_cut LIMIT 1000 FOR UPDATE SKIP LOCKED
  ), gone AS (
    DELETE FROM {keys} AS k
      WHERE k.ctid = ANY(ARRAY(SELECT ctid FROM doomed UNION ALL SELECT ctid FROM everyone))
      RETURNING k.scope, k.key,
        CASE WHEN k.counted THEN 1 ELSE k.carried_records END AS n,
        CASE WHEN k.counted THEN k.bytes ELSE k.carried END AS bytes
  ), shards AS (
    SELECT 'k:' || g.scope AS pool, hashtext(g.key) & 15 AS shard, sum(g.n) AS n, sum(g.bytes) AS b
      FROM gone AS g WHERE g.n > 0 OR g.bytes <> 0 GROUP BY 1, 2
  ), counted AS (
    UPDATE {tally} AS t SET records = t.records - s.n, bytes = t.bytes - s.b
      FROM shards AS s WHERE t.pool = s.pool AND t.shard = s.shard
  )
  SELECT count(*) INTO v_keys FROM gone;
  IF p_scope IS NULL THEN
    v_tokens := {sweep_tokens}(NULL, t_cut);
  END IF;
  RETURN v_keys + v_tokens;
END
$dlock_body$;
