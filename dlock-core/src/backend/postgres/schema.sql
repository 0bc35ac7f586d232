-- The lease table of one prefix: one row per holder of a key, and one per
-- writer waiting for readers (its intent, mode 'i', owner '~' || owner).
-- mode: 'x' exclusive, 's' shared, 'p<N>' one of N permits. expires_at is
-- on the server's clock (clock_timestamp()); a row past it is no holder,
-- whoever reads it next deletes it. awaited: a waiter was refused while
-- this row held the key, so its release must NOTIFY.
CREATE TABLE IF NOT EXISTS {locks} (
  key text NOT NULL,
  owner text NOT NULL,
  mode text NOT NULL,
  fence bigint NOT NULL,
  expires_at timestamptz NOT NULL,
  awaited boolean NOT NULL DEFAULT false,
  PRIMARY KEY (key, owner)
);
-- Fencing tokens of every key of the prefix, durable across restarts.
CREATE SEQUENCE IF NOT EXISTS {fence} AS bigint;
