-- Frees an exclusive hold ($1 key, $2 owner) whose lease has not run out:
-- its head deleted, one row changed. None changed when the owner held no
-- live exclusive hold of the key (the release function then looks at the
-- holders, or deletes the owner's head whose lease ran out and answers
-- "not held"). A head that a waiter was refused by (`awaited`) announces
-- its end on the prefix's channel, the key as payload. A waiter marks the
-- head under its row lock: this delete waits for that mark and reads it.
-- One plain DELETE with no RETURNING, its answer the command tag alone:
-- with the announcement in a RETURNING the server projects and sends a
-- row at every release (pgbench of the lock cycle, 16 clients: 9,883
-- against 9,482 cycles/s, medians of eight alternating runs), and in a
-- WITH around it, executor nodes it starts every time (15 % more). The
-- announcement's test is the last of the filter (the planner orders
-- filters by cost, and this one costs most): a row of another owner, or
-- one whose lease ran out, announces nothing. It must hold once it has
-- announced (pg_notify's void is not null): a filter that announced and
-- then refused the row would leave the head to the release function,
-- which announces again, and the waiter, woken by the first, would be
-- refused (a_waiter_is_woken_by_notify_not_by_the_lease counts them).
-- {durable} makes the delete's commit durable before it is answered
-- (durable.rs): it never refuses a row, so wherever the planner puts it,
-- every row deleted has passed it, and the announcement's rule holds.
DELETE FROM {locks} AS l
  WHERE l.key = $1 AND l.owner = $2 AND l.expires_at > clock_timestamp() AND {durable} IS NOT NULL
    AND (NOT l.awaited OR pg_notify('{channel_text}', $1) IS NOT NULL)
