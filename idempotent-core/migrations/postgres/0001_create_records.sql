-- idempotent: the records table. `{table}` is replaced by the configured (schema-qualified)
-- table name and `{name}` by the bare table name.
CREATE TABLE IF NOT EXISTS {table} (
    scope        text        NOT NULL,
    key          text        NOT NULL,
    fingerprint  bytea       NOT NULL,
    done         boolean     NOT NULL DEFAULT false,
    token        uuid        NOT NULL,
    locked_until timestamptz,
    status       integer,
    headers      bytea,
    body         bytea,
    oversized    bigint,
    created_at   timestamptz NOT NULL DEFAULT now(),
    completed_at timestamptz,
    expires_at   timestamptz NOT NULL,
    PRIMARY KEY (scope, key)
);
-- The sweeper deletes by expiry in small batches: this index keeps each batch cheap.
CREATE INDEX IF NOT EXISTS {name}_expires_at ON {table} (expires_at);
