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
-- claimed_at: when its request claimed it (an operator's "age"); NULL in a
-- row written before the column was added.
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
  claimed_at timestamptz DEFAULT now(),
  PRIMARY KEY (scope, key)
);
-- A table made by an earlier build gains claimed_at once; the check keeps
-- every later start from taking the table's lock for nothing.
DO $dlock_body$ BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_attribute
                 WHERE attrelid = '{keys}'::regclass AND attname = 'claimed_at' AND NOT attisdropped) THEN
    ALTER TABLE {keys} ADD COLUMN claimed_at timestamptz;
    ALTER TABLE {keys} ALTER COLUMN claimed_at SET DEFAULT now();
  END IF;
END $dlock_body$;
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
-- What expired, across pools: the bound tokens' total discounts it.
CREATE INDEX IF NOT EXISTS {tokens_expiry} ON {tokens} (expires_at);
-- What each pool holds, so that a claim reads a few rows instead of
-- counting its caller's records: pool 'k:<scope>' (records and the bytes
-- of their answers), 't:<principal>' (bound tokens), 'u' (unbound
-- tokens), in 16 shards by key so that concurrent claims of one caller
-- rarely wait for each other; and the totals, 'k' (every caller's records
-- and bytes) and 't' (every bound token), shard by shard, which
-- {tally_add} keeps with every change of a caller's pool. A tally may
-- count what expired and was not swept yet (never less than what lives,
-- but for claims in flight inside transactions): at a cap, what expired
-- is discounted before a refusal.
CREATE TABLE IF NOT EXISTS {tally} (
  pool text NOT NULL,
  shard int NOT NULL,
  records bigint NOT NULL DEFAULT 0,
  bytes bigint NOT NULL DEFAULT 0,
  PRIMARY KEY (pool, shard)
);
-- The totals of a tally an earlier build kept without them: its callers'
-- pools summed, shard by shard, once (no row of a total yet: the check
-- gates the scan, so a start pays for it only then).
INSERT INTO {tally} (pool, shard, records, bytes)
  SELECT 'k', t.shard, sum(t.records), sum(t.bytes) FROM {tally} AS t
    WHERE t.pool LIKE 'k:%' AND NOT EXISTS (SELECT 1 FROM {tally} AS a WHERE a.pool = 'k')
    GROUP BY t.shard
  ON CONFLICT (pool, shard) DO NOTHING;
INSERT INTO {tally} (pool, shard, records, bytes)
  SELECT 't', t.shard, sum(t.records), sum(t.bytes) FROM {tally} AS t
    WHERE t.pool LIKE 't:%' AND NOT EXISTS (SELECT 1 FROM {tally} AS a WHERE a.pool = 't')
    GROUP BY t.shard
  ON CONFLICT (pool, shard) DO NOTHING;
