-- Stores the answer of p_owner's claim of (scope, key): 1 stored; 0 the
-- claim is no longer p_owner's; 5 the answer's bytes do not fit the
-- caller's byte cap (nothing stored, the claim stays), retry ms until
-- its oldest record expires.
CREATE OR REPLACE FUNCTION {complete}(p_scope text, p_key text, p_owner text, p_response bytea,
                                      p_max_bytes_per_scope bigint)
RETURNS TABLE (r_outcome int, r_retry_ms bigint)
LANGUAGE plpgsql VOLATILE AS $dlock_body$
DECLARE
  t_now timestamptz := clock_timestamp();
  used bigint;
  oldest timestamptz;
BEGIN
  PERFORM 1 FROM {keys} AS k
    WHERE k.scope = p_scope AND k.key = p_key AND k.owner = p_owner AND k.response IS NULL
    FOR UPDATE;
  IF NOT FOUND THEN
    RETURN QUERY SELECT 0, 0::bigint;
    RETURN;
  END IF;
  SELECT coalesce(sum(k.bytes), 0), min(k.expires_at) INTO used, oldest
    FROM {keys} AS k WHERE k.scope = p_scope AND k.expires_at > t_now;
  IF used + octet_length(p_response) > p_max_bytes_per_scope THEN
    RETURN QUERY SELECT 5, greatest(1, ceil(extract(epoch FROM oldest - t_now) * 1000))::bigint;
    RETURN;
  END IF;
  UPDATE {keys} AS k SET owner = NULL, lease_until = NULL, response = p_response, bytes = octet_length(p_response)
    WHERE k.scope = p_scope AND k.key = p_key;
  RETURN QUERY SELECT 1, 0::bigint;
END
$dlock_body$;

-- Frees p_owner's claim of (scope, key), so that a retry runs: true when
-- it was p_owner's. It waits for the key's advisory lock, so a claim whose
-- answer was lost, still running on the server, is freed after it.
CREATE OR REPLACE FUNCTION {abandon}(p_scope text, p_key text, p_owner text)
RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $dlock_body$
BEGIN
  PERFORM pg_advisory_xact_lock({class}, hashtext(p_scope || chr(31) || p_key));
  DELETE FROM {keys} AS k
    WHERE k.scope = p_scope AND k.key = p_key AND k.owner = p_owner AND k.response IS NULL
      AND k.expires_at > clock_timestamp();
  RETURN FOUND;
END
$dlock_body$;
