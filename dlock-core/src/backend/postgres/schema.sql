-- The head of every key of one prefix: one row per key. An exclusive hold
-- is its head alone (owner: the holder); a key held shared or by permits
-- has a head whose owner is '' and whose holders are rows of {holders}.
-- mode: 'x' exclusive, 's' shared, 'p<N>' one of N permits. expires_at is
-- on the server's clock (clock_timestamp()); a head past it holds nothing
-- (a shared head's is at least each of its live holders'), and whoever
-- takes the key next overwrites it. awaited: a waiter was refused while
-- the head held the key, so a release must NOTIFY.
CREATE TABLE IF NOT EXISTS {locks} (
  key text PRIMARY KEY,
  owner text NOT NULL,
  mode text NOT NULL,
  fence bigint NOT NULL,
  expires_at timestamptz NOT NULL,
  awaited boolean NOT NULL DEFAULT false
);
-- The holders of keys held shared or by permits, one row each, and the
-- intents of writers waiting for readers (mode 'i', owner '~' || owner).
CREATE TABLE IF NOT EXISTS {holders} (
  key text NOT NULL,
  owner text NOT NULL,
  mode text NOT NULL,
  fence bigint NOT NULL,
  expires_at timestamptz NOT NULL,
  PRIMARY KEY (key, owner)
);
-- Fencing tokens of every key of the prefix, durable across restarts.
CREATE SEQUENCE IF NOT EXISTS {fence} AS bigint;
