-- One try at a lock, whatever the mode (the first try at an exclusive
-- hold is take.sql; this comes after it found the key held). Returns one row:
-- (1, token, mode) granted; (2, token, mode) joined the owner's own hold;
-- (0, 0, ms) held by others, the first of their leases (or a writer's
-- intent that keeps readers out) ends in ms; (3, 0, mode) held in a mode
-- that does not fit the one asked for.
CREATE OR REPLACE FUNCTION {acquire}(p_key text, p_owner text, p_lease_ms bigint, p_mode text,
                                     p_awaited boolean, p_wait_ms bigint)
RETURNS TABLE (r_outcome int, r_fence bigint, r_info text)
LANGUAGE plpgsql VOLATILE AS $dlock_body$
DECLARE
  t_now timestamptz;
  t_exp timestamptz;
  h record;
  r record;
  head_live boolean;
  mine_mode text;
  mine_fence bigint;
  held text;
  holders bigint := 0;
  first_end timestamptz;
  intent_end timestamptz;
  expired boolean := false;
  own_intent boolean := false;
  refused boolean := false;
BEGIN
  -- Every grant of a key draws its token under this lock, held to commit
  -- (see take.sql): grants of one key draw in the order they commit.
  PERFORM pg_advisory_xact_lock(hashtext('{prefix_text}'), hashtext(p_key));
  -- The key's head, made when missing (free: its lease ended long ago),
  -- and locked until commit: every step on a key but take.sql runs one
  -- at a time on it, and take.sql's own write waits for it too.
  INSERT INTO {locks} AS l (key, owner, mode, fence, expires_at) VALUES (p_key, '', 'x', 0, '-infinity')
    ON CONFLICT (key) DO UPDATE SET key = excluded.key
    RETURNING l.owner, l.mode, l.fence, l.expires_at, l.awaited INTO h;
  t_now := clock_timestamp();
  t_exp := t_now + p_lease_ms * interval '1 millisecond';
  head_live := h.expires_at > t_now;
  IF head_live AND h.owner <> '' THEN
    held := 'x';
    holders := 1;
    first_end := h.expires_at;
    IF h.owner = p_owner THEN
      mine_mode := 'x';
      mine_fence := h.fence;
    END IF;
  END IF;
  -- The holders of a shared key, and writers' intents (of any key): one
  -- read of the key's rows (a hot key's index holds many dead versions of
  -- them: every scan of it pays for those), decided here.
  FOR r IN SELECT l.owner, l.mode, l.fence, l.expires_at FROM {holders} AS l WHERE l.key = p_key LOOP
    IF r.expires_at <= t_now THEN
      expired := true;
    ELSIF r.mode = 'i' THEN
      IF r.owner = '~' || p_owner THEN
        own_intent := true;
      ELSE
        intent_end := greatest(intent_end, r.expires_at);
      END IF;
    ELSIF head_live AND h.owner = '' THEN
      IF r.owner = p_owner THEN
        mine_mode := r.mode;
        mine_fence := r.fence;
      END IF;
      held := r.mode;
      holders := holders + 1;
      first_end := least(first_end, r.expires_at);
    ELSE
      -- A holder under a head that is not shared: left from a shared head
      -- whose lease ended and was taken over. It holds nothing.
      expired := true;
    END IF;
  END LOOP;
  IF expired THEN
    DELETE FROM {holders} AS l WHERE l.key = p_key
      AND (l.expires_at <= t_now OR (l.mode <> 'i' AND NOT (head_live AND h.owner = '')));
  END IF;
  IF mine_mode IS NOT NULL THEN
    -- The engine asks again for a key it holds only after it gave its hold
    -- up as lost: the same owner joins it, same token. A writer may read.
    IF mine_mode = p_mode OR (mine_mode = 'x' AND p_mode = 's') THEN
      IF mine_mode = 'x' THEN
        UPDATE {locks} AS l SET expires_at = t_exp, awaited = l.awaited OR p_awaited WHERE l.key = p_key;
      ELSE
        UPDATE {holders} AS l SET expires_at = greatest(l.expires_at, t_exp)
          WHERE l.key = p_key AND l.owner = p_owner;
        UPDATE {locks} AS l SET expires_at = greatest(l.expires_at, t_exp), awaited = l.awaited OR p_awaited
          WHERE l.key = p_key;
      END IF;
      RETURN QUERY SELECT 2, mine_fence, mine_mode;
      RETURN;
    END IF;
    -- A reader asking to write waits for the readers, itself included, as
    -- in process; anything else does not fit.
    IF NOT (mine_mode = 's' AND p_mode = 'x') THEN
      RETURN QUERY SELECT 3, 0::bigint, mine_mode;
      RETURN;
    END IF;
  END IF;
  -- Holders of one key share one mode: an exclusive one alone, readers,
  -- or the permits of one limit.
  IF held IS NOT NULL THEN
    IF held = 'x' OR (held = 's' AND p_mode = 'x') THEN
      refused := true;
    ELSIF held <> p_mode THEN
      RETURN QUERY SELECT 3, 0::bigint, held;
      RETURN;
    ELSIF p_mode = 's' THEN
      -- Writer preference: a live intent keeps new readers out.
      refused := intent_end IS NOT NULL;
      first_end := least(first_end, intent_end);
    ELSE
      refused := holders >= substr(p_mode, 2)::bigint;
    END IF;
  ELSIF p_mode = 's' AND intent_end IS NOT NULL THEN
    refused := true;
    first_end := intent_end;
  END IF;
  IF refused THEN
    -- Marked under the head's row lock: a release waits for it, reads it
    -- and announces itself.
    IF p_awaited AND NOT h.awaited THEN
      UPDATE {locks} AS l SET awaited = true WHERE l.key = p_key;
    END IF;
    -- A writer that will wait records its intent, bounded by its wait.
    IF p_mode = 'x' AND p_wait_ms > 0 THEN
      INSERT INTO {holders} AS l (key, owner, mode, fence, expires_at)
        VALUES (p_key, '~' || p_owner, 'i', 0, t_now + p_wait_ms * interval '1 millisecond')
        ON CONFLICT (key, owner) DO UPDATE SET expires_at = greatest(l.expires_at, excluded.expires_at);
    END IF;
    RETURN QUERY SELECT 0, 0::bigint,
      ceil(greatest(extract(epoch FROM first_end - t_now), 0) * 1000)::bigint::text;
    RETURN;
  END IF;
  IF own_intent THEN
    DELETE FROM {holders} AS l WHERE l.key = p_key AND l.owner = '~' || p_owner;
  END IF;
  IF p_mode = 'x' THEN
    UPDATE {locks} AS l
      SET owner = p_owner, mode = 'x', fence = nextval('{fence_text}'), expires_at = t_exp, awaited = p_awaited
      WHERE l.key = p_key
      RETURNING l.fence INTO r_fence;
  ELSE
    INSERT INTO {holders} (key, owner, mode, fence, expires_at)
      VALUES (p_key, p_owner, p_mode, nextval('{fence_text}'), t_exp)
      RETURNING fence INTO r_fence;
    -- A shared head lives as long as its longest holder; a new one starts
    -- with this holder, unawaited unless this grant's process has waiters.
    IF held IS NULL THEN
      UPDATE {locks} AS l SET owner = '', mode = p_mode, fence = 0, expires_at = t_exp, awaited = p_awaited
        WHERE l.key = p_key;
    ELSE
      UPDATE {locks} AS l SET expires_at = greatest(l.expires_at, t_exp), awaited = l.awaited OR p_awaited
        WHERE l.key = p_key;
    END IF;
  END IF;
  RETURN QUERY SELECT 1, r_fence, p_mode;
END
$dlock_body$;
