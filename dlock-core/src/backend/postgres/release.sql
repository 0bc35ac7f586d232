-- Frees an exclusive hold ($1 key, $2 owner): its head deleted, one row,
-- `live` true when its lease had not run out; no row when the owner held
-- no exclusive hold of the key (the release function then looks at the
-- holders). A head that a waiter was refused by (`awaited`) announces its
-- end on the prefix's channel, the key as payload. A waiter marks the
-- head under its row lock: this delete waits for that mark and reads it.
WITH gone AS (
  DELETE FROM {locks} AS l WHERE l.key = $1 AND l.owner = $2
  RETURNING l.expires_at > clock_timestamp() AS live, l.awaited
)
SELECT g.live, CASE WHEN g.live AND g.awaited THEN (SELECT 1 FROM pg_notify('{channel_text}', $1)) END
  FROM gone AS g
