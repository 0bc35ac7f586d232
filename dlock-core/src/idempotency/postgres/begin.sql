-- Claims (scope, key) for a request whose fingerprint is p_fp. Returns one
-- row (outcome, response, retry ms): 0 claimed by p_owner; 1 in progress
-- (another request holds the key); 2 completed, with its response;
-- 3 the key was used with another fingerprint; 4 its claim's lease ran
-- out without an answer (outcome unknown); 5 the caller holds as many
-- records as its cap allows, 6 the store holds as many as its total
-- allows, the oldest (of the caller, of everyone) expires in retry ms.
-- p_in_tx: called inside the route's own transaction. The claim then
-- holds the key while that transaction lives (its advisory lock and its
-- uncommitted row), and the transaction ends, rolled back by the server,
-- once it stays idle for the lease (idle_in_transaction_session_timeout).
-- Such a claim writes nothing but its own row: it enters the tally after
-- its commit, in a batch (settle.sql's enter), so no shared row stays
-- locked while the route runs or commits.
CREATE OR REPLACE FUNCTION {begin}(p_scope text, p_key text, p_fp text, p_owner text, p_lease_ms bigint,
                                   p_ttl_ms bigint, p_run_again boolean, p_in_tx boolean, p_max_per_scope bigint,
                                   p_max_records bigint)
RETURNS TABLE (r_outcome int, r_response bytea, r_retry_ms bigint)
LANGUAGE plpgsql VOLATILE AS $dlock_body$
DECLARE
  t_now timestamptz;
  rec record;
  v_live bigint;
  v_all bigint;
  v_gone bigint;
  v_oldest timestamptz;
  v_lease timestamptz;
  v_pool text := 'k:' || p_scope;
  v_shard int := hashtext(p_key) & 15;
  v_outcome int := 0;
  -- What this claim changes in the tally, applied at its end in one call
  -- ({tally_add}: one order of row locks for every transaction).
  d_pools text[] := '{}';
  d_shards int[] := '{}';
  d_records bigint[] := '{}';
  d_bytes bigint[] := '{}';
BEGIN
  -- One claim of a key at a time, without waiting: a key whose lock is
  -- taken is being claimed, or run inside a transaction, right now.
  IF NOT pg_try_advisory_xact_lock({class}, hashtext(p_scope || chr(31) || p_key)) THEN
    RETURN QUERY SELECT 1, NULL::bytea, 0::bigint;
    RETURN;
  END IF;
  IF p_in_tx THEN
    PERFORM set_config('idle_in_transaction_session_timeout', p_lease_ms::text, true);
  ELSE
    -- Claims of one caller one at a time, so its cap holds exactly (a
    -- claim inside a transaction cannot wait for that: see the docs).
    PERFORM pg_advisory_xact_lock({class} + 1, hashtext(p_scope));
  END IF;
  t_now := clock_timestamp();
  v_lease := CASE WHEN p_in_tx THEN NULL ELSE t_now + p_lease_ms * interval '1 millisecond' END;
  SELECT k.fingerprint, k.owner, k.lease_until, k.response, k.bytes, k.counted, k.expires_at INTO rec
    FROM {keys} AS k WHERE k.scope = p_scope AND k.key = p_key;
  IF FOUND AND rec.expires_at > t_now THEN
    IF rec.fingerprint <> p_fp THEN
      RETURN QUERY SELECT 3, NULL::bytea, 0::bigint;
    ELSIF rec.response IS NOT NULL THEN
      RETURN QUERY SELECT 2, rec.response, 0::bigint;
    ELSIF rec.lease_until IS NOT NULL AND rec.lease_until > t_now THEN
      RETURN QUERY SELECT 1, NULL::bytea, 0::bigint;
    ELSIF NOT p_run_again THEN
      -- Its lease ran out, or (lease NULL) the transaction that claimed it
      -- committed without an answer: whether its work ran is unknown.
      RETURN QUERY SELECT 4, NULL::bytea, 0::bigint;
    ELSE
      -- Taken over: the old owner can no longer complete it.
      UPDATE {keys} AS k SET owner = p_owner, lease_until = v_lease, claimed_at = t_now
        WHERE k.scope = p_scope AND k.key = p_key;
      RETURN QUERY SELECT 0, NULL::bytea, 0::bigint;
    END IF;
    RETURN;
  END IF;
  IF FOUND THEN
    -- An expired record of the key: overwritten in place. Outside a
    -- transaction it stays in the tally as this record, its answer's bytes
    -- leave it now; inside one, the row carries what the tally holds for
    -- it until it enters the tally after the commit.
    UPDATE {keys} AS k SET fingerprint = p_fp, owner = p_owner, lease_until = v_lease, response = NULL, bytes = 0,
        claimed_at = t_now,
        expires_at = t_now + p_ttl_ms * interval '1 millisecond',
        counted = NOT p_in_tx AND k.counted,
        carried_records = CASE WHEN NOT p_in_tx THEN 0
                               WHEN k.counted THEN 1 ELSE k.carried_records END,
        carried = CASE WHEN NOT p_in_tx THEN 0
                       WHEN k.counted THEN k.bytes ELSE k.carried END
      WHERE k.scope = p_scope AND k.key = p_key;
    IF NOT p_in_tx AND rec.counted AND rec.bytes <> 0 THEN
      PERFORM {tally_add}(ARRAY[v_pool], ARRAY[v_shard], ARRAY[0::bigint], ARRAY[-rec.bytes]);
    END IF;
    RETURN QUERY SELECT 0, NULL::bytea, 0::bigint;
    RETURN;
  END IF;
  -- A new record: only it counts against the caps (a retry of one that
  -- exists was answered above, at a cap too). The tally may still count
  -- records that expired: at the caller's cap, they are swept (outside a
  -- transaction) and counted exactly; at the total, they are discounted
  -- by a read of those that expired (no sweep of every caller's rows in a
  -- claim, and none of any row inside a transaction).
  SELECT coalesce(sum(t.records) FILTER (WHERE t.pool = v_pool), 0), coalesce(sum(t.records) FILTER (WHERE t.pool = 'k'), 0)
    INTO v_live, v_all FROM {tally} AS t WHERE t.pool IN (v_pool, 'k');
  IF v_live >= p_max_per_scope THEN
    IF NOT p_in_tx THEN
      SELECT coalesce(array_agg(x.r_pool), '{}'), coalesce(array_agg(x.r_shard), '{}'),
             coalesce(array_agg(x.r_records), '{}'), coalesce(array_agg(x.r_bytes), '{}')
        INTO d_pools, d_shards, d_records, d_bytes FROM {expired}(p_scope, t_now) AS x;
      -- Swept here, out of the total once applied.
      v_all := v_all + coalesce((SELECT sum(n) FROM unnest(d_records) AS n), 0);
    END IF;
    SELECT count(*), min(k.expires_at) INTO v_live, v_oldest
      FROM {keys} AS k WHERE k.scope = p_scope AND k.expires_at > t_now;
    IF v_live >= p_max_per_scope THEN
      v_outcome := 5;
    END IF;
  END IF;
  IF v_outcome = 0 AND v_all >= p_max_records THEN
    SELECT coalesce(sum(CASE WHEN k.counted THEN 1 ELSE k.carried_records END), 0) INTO v_gone
      FROM {keys} AS k WHERE k.expires_at <= t_now;
    IF v_all - v_gone >= p_max_records THEN
      v_outcome := 6;
      SELECT min(k.expires_at) INTO v_oldest FROM {keys} AS k WHERE k.expires_at > t_now;
    END IF;
  END IF;
  IF v_outcome = 0 THEN
    INSERT INTO {keys} (scope, key, fingerprint, owner, lease_until, response, bytes, expires_at, counted, claimed_at)
      VALUES (p_scope, p_key, p_fp, p_owner, v_lease, NULL, 0, t_now + p_ttl_ms * interval '1 millisecond',
              NOT p_in_tx, t_now);
    IF NOT p_in_tx THEN
      d_pools := d_pools || v_pool;
      d_shards := d_shards || v_shard;
      d_records := d_records || 1::bigint;
      d_bytes := d_bytes || 0::bigint;
    END IF;
  END IF;
  IF cardinality(d_pools) > 0 THEN
    PERFORM {tally_add}(d_pools, d_shards, d_records, d_bytes);
  END IF;
  RETURN QUERY SELECT v_outcome, NULL::bytea,
    CASE WHEN v_outcome = 0 THEN 0::bigint
         ELSE greatest(1, ceil(extract(epoch FROM coalesce(v_oldest, t_now) - t_now) * 1000))::bigint END;
END
$dlock_body$;
