-- idempotent: transactional mode's claim and complete as functions, so that they can travel in
-- the same simple query as BEGIN and as COMMIT (one round trip each) and still run from plans
-- the session keeps (PL/pgSQL prepares each statement once per session). Both fail, with
-- their own SQLSTATE, when they did not do their work, so nothing after them in the query runs.
-- `{table}` is replaced by the configured (schema-qualified) table name.

-- The claim of a single-commit execution after a read that found no record: only the holder
-- of the key's advisory lock inserts, as in the claim the library sends otherwise.
CREATE OR REPLACE FUNCTION {table}_claim_first(
    p_scope text, p_key text, p_fingerprint bytea, p_token uuid,
    p_lease_ms float8, p_expires_ms float8, p_lock bigint)
RETURNS void LANGUAGE plpgsql AS $fn$
BEGIN
    IF NOT pg_try_advisory_xact_lock(p_lock) THEN
        RAISE EXCEPTION 'idempotent: not claimed: another transaction holds the key'
            USING ERRCODE = 'IDM01';
    END IF;
    INSERT INTO {table} (scope, key, fingerprint, done, token, locked_until, created_at, expires_at)
    VALUES (p_scope, p_key, p_fingerprint, false, p_token,
            statement_timestamp() + p_lease_ms * interval '1 millisecond',
            statement_timestamp(),
            statement_timestamp() + p_expires_ms * interval '1 millisecond')
    ON CONFLICT (scope, key) DO NOTHING;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'idempotent: not claimed: a record exists' USING ERRCODE = 'IDM01';
    END IF;
END
$fn$;

-- The fenced complete inside a transaction (both commit paths): a stale owner (its lease
-- taken over) matches no row, and fails.
CREATE OR REPLACE FUNCTION {table}_complete(
    p_scope text, p_key text, p_token uuid, p_status integer, p_headers bytea, p_body bytea,
    p_oversized bigint, p_ttl_ms float8)
RETURNS void LANGUAGE plpgsql AS $fn$
BEGIN
    UPDATE {table} SET done = true, status = p_status, headers = p_headers, body = p_body,
        oversized = p_oversized, completed_at = statement_timestamp(), locked_until = NULL,
        expires_at = GREATEST(expires_at, statement_timestamp() + p_ttl_ms * interval '1 millisecond')
    WHERE scope = p_scope AND key = p_key AND token = p_token AND NOT done
      AND expires_at > statement_timestamp();
    IF NOT FOUND THEN
        RAISE EXCEPTION 'idempotent: the fence refused the complete' USING ERRCODE = 'IDM02';
    END IF;
END
$fn$;
