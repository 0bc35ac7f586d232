-- Frees an exclusive hold ($1 key, $2 owner): its head deleted, one row,
-- `live` true when its lease had not run out; no row when the owner held
-- no exclusive hold of the key (the release function then looks at the
-- holders). A live head that a waiter was refused by (`awaited`)
-- announces its end on the prefix's channel, the key as payload. A waiter
-- marks the head under its row lock: this delete waits for that mark and
-- reads it. One plain DELETE: the same with the announcement in a
-- subquery of a WITH around it cost the server 15 % more a lock cycle
-- (pgbench, 16 clients), for the executor nodes it starts every time.
DELETE FROM {locks} AS l WHERE l.key = $1 AND l.owner = $2
  RETURNING l.expires_at > clock_timestamp() AS live,
    CASE WHEN l.awaited AND l.expires_at > clock_timestamp() THEN pg_notify('{channel_text}', $1) IS NULL END
