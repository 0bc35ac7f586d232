-- A key's live holders and what waits left there, for an operator
-- (Locker::inspect), changing nothing ($1 key). kind 'h' a holder: the
-- head of an exclusive hold, or a row of {holders} for a shared hold or a
-- permit; kind 'w' what a wait left: a writer's intent (mode 'i') or a
-- waiting permit's place, owner '~' || its owner. left_ms: its lease left,
-- on the server's clock.
SELECT 'h' AS kind, l.owner, l.mode, l.fence,
       (extract(epoch FROM l.expires_at - clock_timestamp()) * 1000)::bigint AS left_ms
  FROM {locks} AS l
  WHERE l.key = $1 AND l.owner <> '' AND l.expires_at > clock_timestamp()
UNION ALL
SELECT CASE WHEN left(l.owner, 1) = '~' THEN 'w' ELSE 'h' END, l.owner, l.mode, l.fence,
       (extract(epoch FROM l.expires_at - clock_timestamp()) * 1000)::bigint
  FROM {holders} AS l
  WHERE l.key = $1 AND l.expires_at > clock_timestamp()
