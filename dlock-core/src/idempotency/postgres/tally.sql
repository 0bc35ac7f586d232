-- Adds p_records and p_bytes to the tally rows (p_pools, p_shards), index
-- by index (negative to take out), and the same to their pools' total:
-- every caller's records ('k:<scope>') to 'k', every bound token
-- ('t:<principal>') to 't' (unbound tokens, 'u', are a pool of their own).
-- Every change of the tally goes through here, once per transaction, so
-- the totals are the sum of the callers' pools by construction. The rows
-- are locked in one order (pool in byte order, then shard), the order of
-- every other transaction that changes the tally: two that change the
-- same rows wait for each other, never in a cycle (a claim that swept its
-- caller's expired records and then counted its own, in two calls, could
-- hold one total shard and wait for another that a second such claim
-- holds while it waits for the first). Returns how many rows changed.
CREATE OR REPLACE FUNCTION {tally_add}(p_pools text[], p_shards int[], p_records bigint[], p_bytes bigint[])
RETURNS int
LANGUAGE plpgsql VOLATILE AS $dlock_body$
DECLARE
  v_pools text[];
  v_shards int[];
  v_records bigint[];
  v_bytes bigint[];
BEGIN
  IF cardinality(p_pools) = 1 THEN
    -- One row, the common case (a claim, an answer, a token): its total's
    -- first, as the order below puts it, with plain statements.
    IF p_pools[1] LIKE 'k:%' OR p_pools[1] LIKE 't:%' THEN
      INSERT INTO {tally} AS t (pool, shard, records, bytes) VALUES (left(p_pools[1], 1), p_shards[1], p_records[1], p_bytes[1])
        ON CONFLICT (pool, shard) DO UPDATE SET records = t.records + excluded.records, bytes = t.bytes + excluded.bytes;
    END IF;
    INSERT INTO {tally} AS t (pool, shard, records, bytes) VALUES (p_pools[1], p_shards[1], p_records[1], p_bytes[1])
      ON CONFLICT (pool, shard) DO UPDATE SET records = t.records + excluded.records, bytes = t.bytes + excluded.bytes;
    RETURN 1;
  END IF;
  WITH asked AS (
    SELECT u.pool, u.shard, u.n, u.b FROM unnest(p_pools, p_shards, p_records, p_bytes) AS u(pool, shard, n, b)
  ), rows AS (
    SELECT a.pool, a.shard, a.n, a.b FROM asked AS a
    UNION ALL
    SELECT left(a.pool, 1), a.shard, a.n, a.b FROM asked AS a WHERE a.pool LIKE 'k:%' OR a.pool LIKE 't:%'
  ), merged AS (
    SELECT r.pool, r.shard, sum(r.n)::bigint AS n, sum(r.b)::bigint AS b FROM rows AS r
      GROUP BY r.pool, r.shard HAVING sum(r.n) <> 0 OR sum(r.b) <> 0
  )
  SELECT array_agg(m.pool ORDER BY m.pool COLLATE "C", m.shard), array_agg(m.shard ORDER BY m.pool COLLATE "C", m.shard),
         array_agg(m.n ORDER BY m.pool COLLATE "C", m.shard), array_agg(m.b ORDER BY m.pool COLLATE "C", m.shard)
    INTO v_pools, v_shards, v_records, v_bytes FROM merged AS m;
  IF v_pools IS NULL THEN
    RETURN 0;
  END IF;
  PERFORM 1 FROM {tally} AS t JOIN unnest(v_pools, v_shards) AS u(pool, shard) ON t.pool = u.pool AND t.shard = u.shard
    ORDER BY t.pool COLLATE "C", t.shard FOR UPDATE OF t;
  -- Rows not there yet are inserted, in the same order.
  INSERT INTO {tally} AS t (pool, shard, records, bytes)
    SELECT u.pool, u.shard, u.n, u.b FROM unnest(v_pools, v_shards, v_records, v_bytes) WITH ORDINALITY AS u(pool, shard, n, b, i)
      ORDER BY u.i
    ON CONFLICT (pool, shard) DO UPDATE SET records = t.records + excluded.records, bytes = t.bytes + excluded.bytes;
  RETURN array_length(v_pools, 1);
END
$dlock_body$;
