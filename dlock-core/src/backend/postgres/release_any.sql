-- Frees the owner's hold of a key, whatever its mode: the release of a
-- shared hold or a permit, and of any hold after an acquire whose answer
-- was lost (release.sql frees an exclusive one otherwise). Its first step
-- locks the key's head, which waits for a write of it still running on
-- the server (that lost acquire's), so this lands after it. Returns true
-- when it held the key (its lease had not run out). A hold that a waiter
-- was refused by announces its end on the prefix's channel, the key as
-- payload; the last holder of a shared key deletes its head.
-- With p_only_waits, it takes back only what the waits of p_owner left,
-- never a hold: the withdrawal of an acquire that ended without a grant
-- before its wait did (Backend::withdraw). That is a writer's intent
-- (mode 'i', owner '~' || p_owner), which keeps new readers out: its end
-- is announced when a waiter was refused (by it, or by the holders), so
-- the readers it kept out try again. Returns true when it took one back.
CREATE OR REPLACE FUNCTION {release}(p_key text, p_owner text, p_only_waits boolean)
RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $dlock_body$
DECLARE
  h record;
  t_now timestamptz;
  live boolean;
  withdrew boolean;
BEGIN
  INSERT INTO {locks} AS l (key, owner, mode, fence, expires_at) VALUES (p_key, '', 'x', 0, '-infinity')
    ON CONFLICT (key) DO UPDATE SET key = excluded.key
    RETURNING l.owner, l.mode, l.expires_at, l.awaited INTO h;
  t_now := clock_timestamp();
  IF p_only_waits THEN
    DELETE FROM {holders} AS l WHERE l.key = p_key AND l.owner = '~' || p_owner AND l.mode = 'i'
      RETURNING l.expires_at > t_now INTO withdrew;
    withdrew := coalesce(withdrew, false);
    -- Its readers may go, unless the key is held exclusive: they would only
    -- be refused again.
    IF withdrew AND h.awaited AND NOT (h.owner <> '' AND h.expires_at > t_now) THEN
      PERFORM pg_notify('{channel_text}', p_key);
    END IF;
    live := withdrew;
  ELSIF h.owner = p_owner THEN
    DELETE FROM {locks} AS l WHERE l.key = p_key;
    live := h.expires_at > t_now;
  ELSE
    DELETE FROM {holders} AS l WHERE l.key = p_key AND l.owner = p_owner AND l.mode <> 'i'
      RETURNING l.expires_at > t_now AND h.owner = '' AND h.expires_at > t_now INTO live;
  END IF;
  IF h.owner = '' AND NOT EXISTS (
    SELECT 1 FROM {holders} AS l WHERE l.key = p_key AND l.mode <> 'i' AND l.expires_at > t_now
  ) THEN
    -- No holder left (or the head was made just now, by this): the key
    -- is free, and its head goes.
    DELETE FROM {locks} AS l WHERE l.key = p_key;
  END IF;
  live := coalesce(live, false);
  IF live AND h.awaited AND NOT p_only_waits THEN
    PERFORM pg_notify('{channel_text}', p_key);
  END IF;
  RETURN live;
END
$dlock_body$;
