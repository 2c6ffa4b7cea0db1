-- idempotent: the records table. `{table}` is replaced by the configured table name.
-- Times are integer milliseconds since the Unix epoch, read from SQLite's clock.
CREATE TABLE IF NOT EXISTS {table} (
    scope        TEXT    NOT NULL,
    key          TEXT    NOT NULL,
    fingerprint  BLOB    NOT NULL,
    done         INTEGER NOT NULL DEFAULT 0,
    token        BLOB    NOT NULL,
    locked_until INTEGER,
    status       INTEGER,
    headers      BLOB,
    body         BLOB,
    oversized    INTEGER,
    created_at   INTEGER NOT NULL,
    completed_at INTEGER,
    expires_at   INTEGER NOT NULL,
    PRIMARY KEY (scope, key)
);
-- The sweeper deletes by expiry in small batches: this index keeps each batch cheap.
CREATE INDEX IF NOT EXISTS {table}_expires_at ON {table} (expires_at);
