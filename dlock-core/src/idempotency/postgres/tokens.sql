-- Issues p_token, bound to p_principal (NULL: unbound), for p_ttl_ms.
-- Returns 0, or the ms until the oldest token of its pool expires when the
-- pool (the principal's tokens, or all unbound ones) holds p_max already.
CREATE OR REPLACE FUNCTION {issue}(p_token text, p_principal text, p_ttl_ms bigint, p_max bigint)
RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $dlock_body$
DECLARE
  t_now timestamptz;
  live bigint;
  oldest timestamptz;
BEGIN
  -- Issues to one pool one at a time, so its cap holds exactly.
  PERFORM pg_advisory_xact_lock({class} + 2, hashtext(coalesce(p_principal, '')));
  t_now := clock_timestamp();
  IF p_principal IS NULL THEN
    SELECT count(*), min(t.expires_at) INTO live, oldest FROM {tokens} AS t
      WHERE t.principal IS NULL AND t.expires_at > t_now;
  ELSE
    SELECT count(*), min(t.expires_at) INTO live, oldest FROM {tokens} AS t
      WHERE t.principal = p_principal AND t.expires_at > t_now;
  END IF;
  IF live >= p_max THEN
    RETURN greatest(1, ceil(extract(epoch FROM oldest - t_now) * 1000))::bigint;
  END IF;
  INSERT INTO {tokens} (token, principal, owner, lease_until, expires_at)
    VALUES (p_token, p_principal, NULL, NULL, t_now + p_ttl_ms * interval '1 millisecond');
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
