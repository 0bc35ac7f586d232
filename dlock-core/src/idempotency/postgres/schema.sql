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
CREATE TABLE IF NOT EXISTS {keys} (
  scope text NOT NULL,
  key text NOT NULL,
  fingerprint text NOT NULL,
  owner text,
  lease_until timestamptz,
  response bytea,
  bytes bigint NOT NULL DEFAULT 0,
  expires_at timestamptz NOT NULL,
  PRIMARY KEY (scope, key)
);
CREATE INDEX IF NOT EXISTS {keys_expiry} ON {keys} (expires_at);
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
