-- Frees the owner's hold of a key ($1 key, $2 owner): one row, `live`
-- true when it held it (its lease had not run out); no row when it held
-- nothing. A hold that a waiter was refused by (`awaited`) announces its
-- end on the prefix's channel, the key as payload. One plain statement,
-- without the key's advisory lock: a waiter that marks a holder awaited
-- either marks it before this deletes it (this then waits for the mark's
-- row lock and reads the mark), or finds it gone and tries again at once
-- (acquire.sql).
WITH gone AS (
  DELETE FROM {locks} AS l WHERE l.key = $1 AND l.owner = $2 AND l.mode <> 'i'
  RETURNING l.expires_at > clock_timestamp() AS live, l.awaited
)
SELECT g.live, CASE WHEN g.live AND g.awaited THEN (SELECT 1 FROM pg_notify('{channel_text}', $1)) END
  FROM gone AS g
