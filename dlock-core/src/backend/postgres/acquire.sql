-- One try at a lock, whatever the mode (the first try at an exclusive
-- hold is take.sql; this comes after it found the key held). Returns one row:
-- (1, token, mode) granted; (2, token, mode) joined the owner's own hold;
-- (0, 0, ms) held by others, the first of their leases (or a writer's
-- intent that keeps readers out) ends in ms; (3, 0, mode) held in a mode
-- that does not fit the one asked for (or kept in it by waiting permits).
-- What waits leave in {holders} has the owner '~' || the waiter's: a
-- writer's intent (mode 'i'), which keeps new readers out, and a waiting
-- permit's place (its mode, 'p<N>'), which keeps the key a semaphore of N
-- while it waits, also once nobody holds it. Each lives until its wait
-- would end; a grant deletes the owner's, and so does a withdrawal
-- (release_any.sql).
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
  own_wait boolean := false;
  places text;
  places_end timestamptz;
  place_end timestamptz;
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
  -- The holders of a shared key, writers' intents (of any key) and
  -- waiting permits' places: one read of the key's rows (a hot key's index
  -- holds many dead versions of them: every scan of it pays for those),
  -- decided here. What this owner's own waits left fixes nothing for it.
  FOR r IN SELECT l.owner, l.mode, l.fence, l.expires_at FROM {holders} AS l WHERE l.key = p_key LOOP
    IF r.expires_at <= t_now THEN
      expired := true;
    ELSIF r.owner = '~' || p_owner THEN
      own_wait := true;
    ELSIF r.mode = 'i' THEN
      intent_end := greatest(intent_end, r.expires_at);
    ELSIF left(r.owner, 1) = '~' THEN
      places := r.mode;
      places_end := greatest(places_end, r.expires_at);
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
      AND (l.expires_at <= t_now OR (left(l.owner, 1) <> '~' AND NOT (head_live AND h.owner = '')));
  END IF;
  -- Nobody holds it, and a permit waits for it: a semaphore of that limit,
  -- for a newcomer as for the waiter.
  IF held IS NULL THEN
    held := places;
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
    -- A writer that will wait records its intent, and a permit that will
    -- wait for every permit of its limit its place, bounded by its wait.
    IF p_wait_ms > 0 AND (p_mode = 'x' OR (p_mode LIKE 'p%' AND held = p_mode)) THEN
      place_end := t_now + p_wait_ms * interval '1 millisecond';
      INSERT INTO {holders} AS l (key, owner, mode, fence, expires_at)
        VALUES (p_key, '~' || p_owner, CASE WHEN p_mode = 'x' THEN 'i' ELSE p_mode END, 0, place_end)
        ON CONFLICT (key, owner) DO UPDATE
          SET mode = excluded.mode, expires_at = greatest(l.expires_at, excluded.expires_at);
      IF p_mode = 'x' THEN
        place_end := NULL;
      END IF;
    END IF;
    -- Marked under the head's row lock: a release waits for it, reads it
    -- and announces itself. A head lives as long as its places: the first
    -- try at an exclusive hold (take.sql) looks at the head alone.
    IF (p_awaited AND NOT h.awaited) OR place_end > h.expires_at THEN
      UPDATE {locks} AS l SET awaited = l.awaited OR p_awaited, expires_at = greatest(l.expires_at, place_end)
        WHERE l.key = p_key;
    END IF;
    RETURN QUERY SELECT 0, 0::bigint,
      ceil(greatest(extract(epoch FROM first_end - t_now), 0) * 1000)::bigint::text;
    RETURN;
  END IF;
  IF own_wait THEN
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
    -- A shared head lives as long as its longest holder or place; a new
    -- one starts with this holder, unawaited unless this grant's process
    -- has waiters (or other permits wait for it).
    IF holders = 0 THEN
      UPDATE {locks} AS l SET owner = '', mode = p_mode, fence = 0, expires_at = greatest(t_exp, places_end),
          awaited = p_awaited OR (places IS NOT NULL AND head_live AND l.awaited)
        WHERE l.key = p_key;
    ELSE
      UPDATE {locks} AS l SET expires_at = greatest(l.expires_at, t_exp), awaited = l.awaited OR p_awaited
        WHERE l.key = p_key;
    END IF;
  END IF;
  RETURN QUERY SELECT 1, r_fence, p_mode;
END
$dlock_body$;
