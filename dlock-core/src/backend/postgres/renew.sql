-- Extends the holds of a batch ($1 keys, $2 owners, $3 leases in ms,
-- index by index) from the server's now; returns the (key, owner) of each
-- hold that was still its owner's and is now extended.
CREATE OR REPLACE FUNCTION {renew}(p_keys text[], p_owners text[], p_ms bigint[])
RETURNS TABLE (r_key text, r_owner text)
LANGUAGE plpgsql VOLATILE AS $dlock_body$
BEGIN
  -- Exclusive holds: their heads.
  RETURN QUERY
    UPDATE {locks} AS l SET expires_at = clock_timestamp() + v.ms * interval '1 millisecond'
      FROM unnest(p_keys, p_owners, p_ms) AS v(key, owner, ms)
      WHERE l.key = v.key AND l.owner = v.owner AND l.expires_at > clock_timestamp()
      RETURNING l.key, l.owner;
  IF NOT EXISTS (
    SELECT 1 FROM {holders} AS h JOIN unnest(p_keys, p_owners) AS v(key, owner)
      ON h.key = v.key AND h.owner = v.owner
  ) THEN
    RETURN;
  END IF;
  -- Shared holds: their heads locked first (in one order, so two batches
  -- cannot deadlock), so none is taken over between the check that it
  -- lives and the extension of its holders and of itself.
  PERFORM 1 FROM {locks} AS l
    WHERE l.owner = '' AND l.key IN (SELECT h.key FROM {holders} AS h
      JOIN unnest(p_keys, p_owners) AS v(key, owner) ON h.key = v.key AND h.owner = v.owner)
    ORDER BY l.key FOR UPDATE;
  RETURN QUERY
    WITH extended AS (
      UPDATE {holders} AS h SET expires_at = clock_timestamp() + v.ms * interval '1 millisecond'
        FROM unnest(p_keys, p_owners, p_ms) AS v(key, owner, ms), {locks} AS l
        WHERE h.key = v.key AND h.owner = v.owner AND h.mode <> 'i' AND h.expires_at > clock_timestamp()
          AND l.key = h.key AND l.owner = '' AND l.expires_at > clock_timestamp()
        RETURNING h.key, h.owner, h.expires_at
    ), heads AS (
      UPDATE {locks} AS l SET expires_at = greatest(l.expires_at, e.until)
        FROM (SELECT x.key, max(x.expires_at) AS until FROM extended AS x GROUP BY x.key) AS e
        WHERE l.key = e.key
    )
    SELECT x.key, x.owner FROM extended AS x;
END
$dlock_body$;
