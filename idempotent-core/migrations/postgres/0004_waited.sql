-- Set by a request that waits for this record's answer, so its complete or release sends the
-- notification that wakes it (`pg_notify` costs every committing transaction a turn on
-- PostgreSQL's notification queue lock: only records someone waits on pay it). Not indexed,
-- so completes stay HOT updates. A column with a constant default: no table rewrite.
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS waited boolean NOT NULL DEFAULT false;
