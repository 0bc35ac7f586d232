-- Frees the owner's hold of a key, whatever its mode: the release of a
-- shared hold or a permit, and of any hold after an acquire whose answer
-- was lost (release.sql frees an exclusive one otherwise). Its first step
-- locks the key's head, which waits for a write of it still running on
-- the server (that lost acquire's), so this lands after it. Returns true
-- when it held the key (its lease had not run out). A hold that a waiter
-- was refused by announces its end on the prefix's channel, the key as
-- payload; the last holder of a shared key deletes its head, unless
-- waiting permits keep their places there (acquire.sql): the head then
-- lives as long as they do. What the owner's own waits left goes with it.
-- With p_only_waits, it takes back only what the waits of p_owner left
-- (rows of owner '~' || p_owner), never a hold: the withdrawal of an
-- acquire that ended without a grant before its wait did
-- (Backend::withdraw). A writer's intent kept new readers out: its end is
-- announced when a waiter was refused (by it, or by the holders), so the
-- readers it kept out try again. A permit's place kept the key's limit.
-- Returns true when it took one back.
CREATE OR REPLACE FUNCTION {release}(p_key text, p_owner text, p_only_waits boolean)
RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $dlock_body$
DECLARE
  h record;
  t_now timestamptz;
  freed boolean := false;
  withdrew boolean := false;
  intent_gone boolean := false;
  places_end timestamptz;
BEGIN
  INSERT INTO {locks} AS l (key, owner, mode, fence, expires_at) VALUES (p_key, '', 'x', 0, '-infinity')
    ON CONFLICT (key) DO UPDATE SET key = excluded.key
    RETURNING l.owner, l.mode, l.expires_at, l.awaited INTO h;
  t_now := clock_timestamp();
  IF h.owner = p_owner AND NOT p_only_waits THEN
    DELETE FROM {locks} AS l WHERE l.key = p_key;
    freed := h.expires_at > t_now;
  ELSE
    WITH gone AS (
      DELETE FROM {holders} AS l
        WHERE l.key = p_key AND (l.owner = '~' || p_owner OR (l.owner = p_owner AND NOT p_only_waits))
        RETURNING l.owner = p_owner AS hold, l.mode, l.expires_at > t_now AS live
    )
    SELECT coalesce(bool_or(g.live) FILTER (WHERE g.hold), false),
           coalesce(bool_or(g.live) FILTER (WHERE NOT g.hold), false),
           coalesce(bool_or(g.live) FILTER (WHERE NOT g.hold AND g.mode = 'i'), false)
      INTO freed, withdrew, intent_gone FROM gone AS g;
    freed := freed AND h.owner = '' AND h.expires_at > t_now;
  END IF;
  IF h.owner = '' AND NOT EXISTS (
    SELECT 1 FROM {holders} AS l WHERE l.key = p_key AND left(l.owner, 1) <> '~' AND l.expires_at > t_now
  ) THEN
    -- No holder left (or the head was made just now, by this): the key
    -- is free, and its head goes, or lives on for the places left.
    SELECT max(l.expires_at) INTO places_end FROM {holders} AS l
      WHERE l.key = p_key AND left(l.owner, 1) = '~' AND l.mode <> 'i' AND l.expires_at > t_now;
    IF places_end IS NULL THEN
      DELETE FROM {locks} AS l WHERE l.key = p_key;
    ELSE
      UPDATE {locks} AS l SET expires_at = places_end WHERE l.key = p_key;
    END IF;
  END IF;
  -- The readers an intent kept out may go, unless the key is held
  -- exclusive: they would only be refused again.
  IF h.awaited AND (freed OR (intent_gone AND NOT (h.owner <> '' AND h.expires_at > t_now))) THEN
    PERFORM pg_notify('{channel_text}', p_key);
  END IF;
  RETURN CASE WHEN p_only_waits THEN withdrew ELSE freed END;
END
$dlock_body$;
