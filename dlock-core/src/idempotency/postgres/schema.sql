-- Idempotency-key records of one prefix: one row per (caller, key).
-- owner: the claim's owner while its request runs, NULL once completed.
-- lease_until: a claim made by its own statement (IdempotencyStore::begin)
-- holds the key until then unless renewed; NULL for a claim made inside
-- the route's transaction (begin_in), which holds it while that
-- transaction lives (its row is not even visible to others before it
-- commits, and a key advisory lock keeps them out meanwhile).
-- response: the stored answer (StoredResponse::encode), once completed.
-- expires_at is on the server's clock; a row past it is no record, the
-- next claim of its key overwrites it and a sweep deletes it.
-- counted: the row is in its caller's tally. A claim inside a route's
-- transaction never touches the tally (no tally row stays locked while a
-- route runs or commits, and a request pays no statement for it): its
-- committed row enters the tally within a second, in a batch of them
-- (settle.sql's enter), and until then carries what an expired row it
-- overwrote still has there (carried_records, carried bytes), so that a
-- sweep takes out exactly what the tally holds for it.
CREATE TABLE IF NOT EXISTS {keys} (
  scope text NOT NULL,
  key text NOT NULL,
  fingerprint text NOT NULL,
  owner text,
  lease_until timestamptz,
  response bytea,
  bytes bigint NOT NULL DEFAULT 0,
  expires_at timestamptz NOT NULL,
  counted boolean NOT NULL DEFAULT true,
  carried_records int NOT NULL DEFAULT 0,
  carried bigint NOT NULL DEFAULT 0,
  PRIMARY KEY (scope, key)
);
CREATE INDEX IF NOT EXISTS {keys_expiry} ON {keys} (expires_at);
-- The rows still to enter the tally (settle.sql's enter), by key: on the
-- caller, every claim of one caller inserted at the same leaf page, and
-- under load the claims queued for it (an index of that shape, made by an
-- earlier build, is dropped).
CREATE INDEX IF NOT EXISTS {keys_todo} ON {keys} (key) WHERE NOT counted;
DROP INDEX IF EXISTS {keys_pending};
-- One-time tokens: principal NULL for an unbound token; owner and
-- lease_until while a request has claimed it.
CREATE TABLE IF NOT EXISTS {tokens} (
  token text PRIMARY KEY,
  principal text,
  owner text,
  lease_until timestamptz,
  expires_at timestamptz NOT NULL
);
CREATE INDEX IF NOT EXISTS {tokens_pool} ON {tokens} (principal, expires_at);
-- What each pool holds, so that a claim reads a few rows instead of
-- counting its caller's records: pool 'k:<scope>' (records and the bytes
-- of their answers), 't:<principal>' (bound tokens), 'u' (unbound
-- tokens), in 16 shards by key so that concurrent claims of one caller
-- rarely wait for each other. A tally may count what expired and was not
-- swept yet (never less than what lives, but for claims in flight inside
-- transactions): at the cap, the pool is counted exactly before a refusal.
CREATE TABLE IF NOT EXISTS {tally} (
  pool text NOT NULL,
  shard int NOT NULL,
  records bigint NOT NULL DEFAULT 0,
  bytes bigint NOT NULL DEFAULT 0,
  PRIMARY KEY (pool, shard)
);
