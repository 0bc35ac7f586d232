-- Frees the owner's hold of a key after an acquire of it whose answer was
-- lost (release.sql otherwise): it takes the key's advisory lock first, so
-- it lands after that acquire if it is still running on the server.
-- Returns true when it held it (its lease had not run out); a hold that a
-- waiter was refused by announces its end on the prefix's channel, the
-- key as payload.
CREATE OR REPLACE FUNCTION {release}(p_key text, p_owner text)
RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $dlock_body$
DECLARE
  gone record;
BEGIN
  -- In turn with the acquires of the key: a waiter's refusal marks the
  -- hold awaited before this reads it, or comes after it and finds it free.
  PERFORM pg_advisory_xact_lock({class}, hashtext(p_key));
  DELETE FROM {locks} AS l WHERE l.key = p_key AND l.owner = p_owner AND l.mode <> 'i'
    RETURNING l.expires_at > clock_timestamp() AS live, l.awaited INTO gone;
  IF NOT FOUND THEN
    RETURN false;
  END IF;
  IF gone.live AND gone.awaited THEN
    PERFORM pg_notify('{channel_text}', p_key);
  END IF;
  RETURN gone.live;
END
$dlock_body$;
