-- idempotent: the records table (InnoDB). `{table}` is replaced by the configured table name.
-- Scope and key are VARBINARY, compared byte for byte: under a case-insensitive or PAD SPACE
-- collation `Key` and `key`, or `a` and `a `, would be one record. (Scopes are at most 1,024
-- bytes and keys 255: the primary key fits InnoDB's 3,072-byte limit.) Times are integer
-- milliseconds since the Unix epoch, read from the server's UTC clock.
CREATE TABLE IF NOT EXISTS {table} (
    scope        VARBINARY(1024) NOT NULL,
    `key`        VARBINARY(255)  NOT NULL,
    fingerprint  VARBINARY(64)   NOT NULL,
    done         BOOLEAN         NOT NULL DEFAULT FALSE,
    token        BINARY(16)      NOT NULL,
    locked_until BIGINT,
    status       INT,
    headers      LONGBLOB,
    body         LONGBLOB,
    oversized    BIGINT,
    created_at   BIGINT          NOT NULL,
    completed_at BIGINT,
    expires_at   BIGINT          NOT NULL,
    PRIMARY KEY (scope, `key`),
    -- The sweeper deletes by expiry in small batches: this index keeps each batch cheap.
    KEY {name}_expires_at (expires_at)
) ENGINE = InnoDB;
