-- The first try at an exclusive hold ($1 key, $2 owner, $3 lease in ms):
-- the key's head inserted, or taken over when its lease has ended. One
-- plain statement, atomic on the key's unique index: no function, no
-- read before the write. One row (the token) when granted; none when the
-- key is held, which the acquire function then looks into.
--
-- The token is drawn with the row's values, before the unique index is
-- checked; a statement that then waits (for a holder's release being
-- written) or is held up (its server process descheduled) would insert
-- it after holders that drew later ones, and a storage check would turn
-- the new holder away as stale. So the draw is made under the key's
-- transaction-level advisory lock, which every grant of the key takes
-- before it draws (the acquire function too) and keeps until it commits:
-- grants of one key draw in the order they commit. (pgbench, 16 clients
-- on one key: 722 of 9,054 grants got a token below the one before
-- without it, none of 18,847 with it; uncontended, it costs about 2 %.)
--
-- {durable} makes this statement's commit durable before it is answered,
-- whatever the server's synchronous_commit (durable.rs): a grant and its
-- nextval forgotten by a crash would be granted again, same token.
INSERT INTO {locks} AS l (key, owner, mode, fence, expires_at)
  VALUES ($1, $2, 'x',
          CASE WHEN pg_advisory_xact_lock(hashtext('{prefix_text}'), hashtext($1))::text = ''
                AND {durable} IS NOT NULL
            THEN nextval('{fence_text}') END,
          clock_timestamp() + $3 * interval '1 millisecond')
  ON CONFLICT (key) DO UPDATE
    SET owner = excluded.owner, mode = 'x', fence = excluded.fence, expires_at = excluded.expires_at,
        awaited = false
    WHERE l.expires_at <= clock_timestamp()
  RETURNING l.fence
