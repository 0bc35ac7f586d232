-- The first try at an exclusive hold ($1 key, $2 owner, $3 lease in ms):
-- the key's head inserted, or taken over when its lease has ended. One
-- plain statement, atomic on the key's unique index: no function, no
-- read before the write. One row (the token) when granted; none when the
-- key is held, which the acquire function then looks into.
INSERT INTO {locks} AS l (key, owner, mode, fence, expires_at)
  VALUES ($1, $2, 'x', nextval('{fence_text}'), clock_timestamp() + $3 * interval '1 millisecond')
  ON CONFLICT (key) DO UPDATE
    SET owner = excluded.owner, mode = 'x', fence = excluded.fence, expires_at = excluded.expires_at,
        awaited = false
    WHERE l.expires_at <= clock_timestamp()
  RETURNING l.fence
