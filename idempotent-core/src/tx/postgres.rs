//! Transactional mode on PostgreSQL: how the PostgreSQL store opens a handler's transaction
//! (READ COMMITTED, an idle timeout) and claims and completes inside it, with an advisory lock
//! standing for a key's uncommitted claim.

use super::held::{CloseIfCancelled, Held};
use super::{FinishError, FirstClaim, ReadFirst, TxDatabase};
use crate::store::PostgresStore;
use crate::store::fence::LeaseToken;
use crate::store::record::{RecordKey, StoredOutcome};
use crate::store::sql::postgres::claim_query;
use crate::store::sql::{Contention, Decision, MAX_CLAIM_ATTEMPTS, claimed, db_error, millis};
use crate::store::{ClaimOutcome, ClaimRequest, StoreError};
use sqlx::postgres::PgConnection;
use sqlx::{AssertSqlSafe, Row, SqlSafeStr};

impl TxDatabase for sqlx::Postgres {
    type Store = PostgresStore;
    const LABEL: &'static str = "PostgreSQL";

    const ALWAYS_READ_FIRST: bool = false;

    /// READ COMMITTED whatever the database's default (the claim's retry loop and the fenced
    /// complete rely on each statement seeing what committed before it), and, with `idle`, an
    /// idle timeout for this transaction only, so a session frozen inside it (a stopped
    /// process) gives its locks and its key back. One round trip: both go in BEGIN's simple
    /// query. (sqlx 0.9 raises its transaction depth only if that whole query succeeds; the
    /// SET cannot fail here: any role may set this setting, and the value is an integer
    /// clamped to the server's range.)
    async fn begin_tx(
        store: &PostgresStore,
        idle: Option<std::time::Duration>,
        conn: Option<sqlx::pool::PoolConnection<sqlx::Postgres>>,
    ) -> Result<Held<sqlx::Postgres>, StoreError> {
        let mut begin = String::from(BEGIN);
        if let Some(idle) = idle {
            push_idle(&mut begin, idle);
        }
        let conn = match conn {
            Some(conn) => conn,
            None => store.pool.acquire().await.map_err(db_error)?,
        };
        // What `Pool::begin_with` does, on a connection already held.
        match Held::begin(conn, AssertSqlSafe(begin).into_sql_str()).await {
            Ok(tx) => Ok(tx),
            Err((e, conn)) => Err(end_failed_batch(e, conn).await),
        }
    }

    /// `BEGIN …; SET LOCAL …;` and the claim in one simple query: a call of the store's
    /// `<table>_claim_first` function (migration 3) with the values written into the text
    /// (the simple protocol has no parameters; see [`push_text`] and [`push_bytes`]), which
    /// inserts only as the holder of the key's advisory lock. sqlx reads no rows from a
    /// BEGIN, so the function answers by succeeding or failing: when it did not insert
    /// (another transaction holds the key, or a record appeared since the read) it raises
    /// SQLSTATE `IDM01`, the transaction is rolled back and the ordinary path (BEGIN, then
    /// the full claim) settles the request. The read says when another transaction holds
    /// the key (a first attempt running), and then this is not tried; so the failure costs
    /// two round trips more, and an ERROR line in the server's log, only when another
    /// request took the key between this one's read and its claim.
    async fn claim_first(
        store: &PostgresStore,
        conn: sqlx::pool::PoolConnection<sqlx::Postgres>,
        idle: std::time::Duration,
        req: ClaimRequest<'_>,
    ) -> Result<FirstClaim<sqlx::Postgres>, StoreError> {
        let token = LeaseToken::generate();
        let lock = lock_id(&store.sql.table, req.key);
        let mut sql = String::with_capacity(512);
        sql.push_str(BEGIN);
        push_idle(&mut sql, idle);
        sql.push_str("; SELECT ");
        sql.push_str(&store.sql.table);
        sql.push_str("_claim_first(");
        push_text(&mut sql, req.key.scope.as_str(), utf8(store));
        sql.push_str(", ");
        push_text(&mut sql, req.key.key.as_str(), utf8(store));
        sql.push_str(", ");
        push_bytes(&mut sql, &req.fingerprint.to_stored());
        let lease = millis(req.lease);
        let expires = millis(req.lease.saturating_add(req.ttl));
        sql.push_str(&format!(
            ", '{token}'::uuid, {lease}::float8, {expires}::float8, '{lock}'::int8)",
            token = token.as_uuid(),
        ));
        store.sent.bump();
        match Held::begin(conn, AssertSqlSafe(sql).into_sql_str()).await {
            Ok(tx) => Ok(FirstClaim::Claimed(tx, token)),
            Err((e, conn)) if has_code(&e, NOT_CLAIMED) => match roll_back_failed(conn).await {
                Ok(conn) => Ok(FirstClaim::Fallback(conn)),
                Err(e) => Err(db_error(e)),
            },
            Err((e, conn)) => Err(end_failed_batch(e, conn).await),
        }
    }

    /// The functions of migration 3, executable by this role: checked with one statement
    /// until found once, so a store whose table predates them answers 503 (the log names
    /// [`PostgresStore::migrate`]) before any handler runs, instead of after it.
    async fn ready(store: &PostgresStore) -> Result<(), StoreError> {
        use std::sync::atomic::Ordering;
        if store.functions_ready.load(Ordering::Acquire) {
            return Ok(());
        }
        let t = &store.sql.table;
        let claim = format!(
            "{t}_claim_first(text, text, bytea, uuid, double precision, double precision, bigint)"
        );
        let complete = format!(
            "{t}_complete(text, text, uuid, integer, bytea, bytea, bigint, double precision)"
        );
        let (ok, utf8): (Option<bool>, bool) = sqlx::query_as(
            "SELECT has_function_privilege(to_regprocedure($1), 'EXECUTE') \
             AND has_function_privilege(to_regprocedure($2), 'EXECUTE'), \
             current_setting('server_encoding') = 'UTF8'",
        )
        .bind(claim)
        .bind(complete)
        .fetch_one(&store.pool)
        .await
        .map_err(db_error)?;
        if ok == Some(true) {
            // Before the flag below, which the batches read it after.
            store.server_utf8.store(utf8, Ordering::Relaxed);
            store.functions_ready.store(true, Ordering::Release);
            Ok(())
        } else {
            Err(StoreError::unavailable(MissingFunctions))
        }
    }

    async fn acquire(
        store: &PostgresStore,
    ) -> Result<sqlx::pool::PoolConnection<sqlx::Postgres>, StoreError> {
        store.pool.acquire().await.map_err(db_error)
    }

    /// The record, or whether another open transaction holds the key (a first attempt
    /// running): then the ordinary claim follows, which waits for it, rather than the claim
    /// that goes with BEGIN, which would fail on purpose.
    async fn read<'a>(
        store: &'a PostgresStore,
        conn: &'a mut PgConnection,
        req: ClaimRequest<'a>,
    ) -> Result<ReadFirst, StoreError> {
        store.sent.bump();
        let row = sqlx::query(AssertSqlSafe(&*store.sql.tx_read))
            .bind(req.key.scope.as_str())
            .bind(req.key.key.as_str())
            .bind(lock_id(&store.sql.table, req.key))
            .fetch_one(&mut *conn)
            .await
            .map_err(db_error)?;
        if row.try_get::<bool, _>("held").map_err(db_error)? {
            return Ok(ReadFirst::Held);
        }
        if row
            .try_get::<Option<Vec<u8>>, _>("fingerprint")
            .map_err(db_error)?
            .is_none()
        {
            return Ok(ReadFirst::Absent);
        }
        match PostgresStore::decide_row(&row, &req)? {
            Decision::Report(outcome, lives) => Ok(ReadFirst::Settled(outcome, lives)),
            Decision::TakeOver(_) => Ok(ReadFirst::Stale),
        }
    }

    async fn claim_in(
        store: &PostgresStore,
        tx: &mut Held<sqlx::Postgres>,
        req: ClaimRequest<'_>,
    ) -> Result<Option<ClaimOutcome>, StoreError> {
        let conn: &mut PgConnection = tx;
        let fp = req.fingerprint.to_stored();
        let lock = lock_id(&store.sql.table, req.key);
        for _ in 0..MAX_CLAIM_ATTEMPTS {
            let token = LeaseToken::generate();
            store.sent.bump();
            let row = claim_query(&store.sql.tx_claim, &req, &fp, token)
                .bind(lock)
                .fetch_optional(&mut *conn)
                .await
                .map_err(db_error)?;
            // No row: a claimer committed after this statement's snapshot; read it again.
            let Some(row) = row else { continue };
            if row.try_get::<bool, _>("inserted").map_err(db_error)? {
                let until: i64 = row.try_get("locked_until_ms").map_err(db_error)?;
                return Ok(Some(claimed(token, until, false)));
            }
            let locked: bool = row.try_get("locked").map_err(db_error)?;
            if row
                .try_get::<Option<uuid::Uuid>, _>("token")
                .map_err(db_error)?
                .is_none()
            {
                // No committed row, and another transaction holds the key.
                return Ok(None);
            }
            match PostgresStore::decide_row(&row, &req)? {
                Decision::Report(outcome, _) => return Ok(Some(outcome)),
                // Taking over writes the row: only the lock's holder may.
                Decision::TakeOver(_) if !locked => return Ok(None),
                Decision::TakeOver(old) => {
                    if let Some(outcome) = store.take_over(conn, &req, token, old).await? {
                        return Ok(Some(outcome));
                    }
                }
            }
        }
        Err(StoreError::unavailable(Contention))
    }

    /// The fenced complete (a call of the store's `<table>_complete` function, migration 3),
    /// COMMIT and a new, empty BEGIN in one simple query; the transaction sqlx counts is then
    /// ended by a ROLLBACK queued on the connection, which goes out with the pool's release
    /// ping (no round trip of its own, and no warning: it ends that empty transaction). A
    /// complete that matches no row (the fence refused) raises SQLSTATE `IDM02`, so the
    /// statements after it never run and nothing commits. An ERROR the server answers means
    /// nothing committed (the query stops at the failing statement, and a COMMIT that fails
    /// rolls back); a FATAL, or no answer, leaves the COMMIT's fate unknown.
    async fn complete_commit(
        store: &PostgresStore,
        tx: Held<sqlx::Postgres>,
        key: &RecordKey,
        token: LeaseToken,
        outcome: &StoredOutcome,
        ttl: std::time::Duration,
    ) -> Result<(), FinishError<sqlx::Postgres>> {
        let mut tx = tx;
        let mut sql = String::with_capacity(256 + 2 * outcome_len(outcome));
        sql.push_str("SELECT ");
        sql.push_str(&store.sql.table);
        sql.push_str("_complete(");
        push_text(&mut sql, key.scope.as_str(), utf8(store));
        sql.push_str(", ");
        push_text(&mut sql, key.key.as_str(), utf8(store));
        sql.push_str(&format!(", '{}'::uuid, ", token.as_uuid()));
        match outcome {
            StoredOutcome::Response(r) => {
                sql.push_str(&format!("{}, ", r.status));
                push_bytes(&mut sql, &r.encode_headers());
                sql.push_str(", ");
                push_bytes(&mut sql, &r.body);
                sql.push_str(", NULL::int8");
            }
            StoredOutcome::Oversized { status, size } => {
                let size = i64::try_from(*size).unwrap_or(i64::MAX);
                sql.push_str(&format!(
                    "{status}, NULL::bytea, NULL::bytea, '{size}'::int8"
                ));
            }
        }
        sql.push_str(&format!(", {}::float8);\n", millis(ttl)));
        if store.marks.known_present(&store.pool) {
            // The record's waiters, here and in other instances, wake when this commits (if
            // any marked it).
            sql.push_str(&format!(
                "SELECT pg_notify('{}', '{}') FROM {} WHERE scope = ",
                store.sql.channel,
                crate::store::ChangeId::of(key).to_hex(),
                store.sql.table
            ));
            push_text(&mut sql, key.scope.as_str(), utf8(store));
            sql.push_str(" AND key = ");
            push_text(&mut sql, key.key.as_str(), utf8(store));
            sql.push_str(" AND waited;\n");
        }
        sql.push_str("COMMIT;\nBEGIN");
        store.sent.bump();
        match sqlx::raw_sql(AssertSqlSafe(sql)).execute(&mut *tx).await {
            // `tx` is dropped: the ROLLBACK of the empty transaction is queued.
            Ok(_) => Ok(()),
            Err(e) if has_code(&e, FENCE_REFUSED) => {
                Err(FinishError::Complete(StoreError::StaleLease, tx))
            }
            // An ERROR ended the query before its COMMIT applied (or was the COMMIT's own
            // failure, which rolls back). A FATAL (the session terminated) can come after
            // the COMMIT applied: unknown, as a lost connection.
            Err(e) if is_error_severity(&e) => {
                missing_functions(&e);
                Err(FinishError::Complete(db_error(e), tx))
            }
            Err(e) => Err(FinishError::Commit(db_error(e))),
        }
    }

    /// The lease, and at least 10 s: past it the server has ended a single-commit session
    /// that stalled idle (the bound its BEGIN set), so no answer is coming; the floor keeps a
    /// COMMIT that is merely slow (a loaded disk) from being given up on.
    fn finish_bound(lease: std::time::Duration) -> Option<std::time::Duration> {
        Some(crate::engine::write_bound(lease))
    }
}

/// The advisory lock that stands for a key's uncommitted claim: 64 bits of SHA-256 over the
/// table and the length-prefixed (scope, key), so keys never share a lock by concatenation and
/// stores on other tables never collide with this one.
fn lock_id(table: &str, key: &RecordKey) -> i64 {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for part in [table, key.scope.as_str(), key.key.as_str()] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    let digest = h.finalize();
    let mut first = [0; 8];
    first.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(first)
}

/// How every transaction on this store begins: READ COMMITTED whatever the database's default
/// (see [`TxDatabase::begin_tx`]).
const BEGIN: &str = "BEGIN ISOLATION LEVEL READ COMMITTED";

/// The SQLSTATE `<table>_claim_first` raises when it did not insert.
const NOT_CLAIMED: &str = "IDM01";
/// The SQLSTATE `<table>_complete` raises when the fence refused.
const FENCE_REFUSED: &str = "IDM02";

/// Appends `; SET LOCAL idle_in_transaction_session_timeout = <ms>` (the server's limit for
/// this setting is `i32::MAX` ms, about 24.8 days).
fn push_idle(sql: &mut String, idle: std::time::Duration) {
    let ms = millis(idle).clamp(1, i64::from(i32::MAX));
    sql.push_str("; SET LOCAL idle_in_transaction_session_timeout = ");
    sql.push_str(&ms.to_string());
}

/// Appends `s` as an escape string literal (`E'…'`) of ASCII letters, digits and a few
/// punctuation marks, every other character written as a Unicode escape (`\uXXXX`,
/// `\UXXXXXXXX`): the text holds no quote, no literal backslash and no byte outside ASCII,
/// so nothing ends the literal whatever `standard_conforming_strings`, `backslash_quote` or
/// `client_encoding` say (a multi-byte character of a client-only encoding can hide a
/// backslash byte; here there are none). A NUL (which a [`Scope`](crate::Scope) cannot hold
/// anyway) becomes `\u0000`, which PostgreSQL refuses, as it refuses a NUL in a bound
/// parameter: the statement fails. (Written as `convert_from(decode(…))` instead, the batches
/// measured 4 to 10 times slower, and slower the longer a session ran; not understood. That
/// form is kept for non-ASCII text on a server whose encoding is not UTF8, such as
/// SQL_ASCII, which cannot take a Unicode escape above U+007F.)
fn push_text(sql: &mut String, s: &str, server_utf8: bool) {
    use std::fmt::Write;
    if !server_utf8 && !s.is_ascii() {
        // A Unicode escape above U+007F must convert to the server's encoding, which fails
        // on SQL_ASCII; these bytes go as they would as a bound parameter.
        sql.push_str("convert_from(");
        push_bytes(sql, s.as_bytes());
        sql.push_str(", 'UTF8')");
        return;
    }
    sql.push_str("E'");
    for c in s.chars() {
        match c {
            'a'..='z' | 'A'..='Z' | '0'..='9' | '_' | '-' | '.' | ':' | ' ' => sql.push(c),
            c if u32::from(c) <= 0xFFFF => {
                let _ = write!(sql, "\\u{:04X}", u32::from(c));
            }
            c => {
                let _ = write!(sql, "\\U{:08X}", u32::from(c));
            }
        }
    }
    sql.push('\'');
}

/// Whether the server's encoding is UTF8 (learnt by [`TxDatabase::ready`], which runs before
/// any batch).
fn utf8(store: &PostgresStore) -> bool {
    store.server_utf8.load(std::sync::atomic::Ordering::Relaxed)
}

/// Appends `bytes` as `decode('<hex>', 'hex')`: nothing but hex digits stand for them.
fn push_bytes(sql: &mut String, bytes: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    sql.reserve(bytes.len() * 2 + 18);
    sql.push_str("decode('");
    for b in bytes {
        sql.push(char::from(HEX[usize::from(b >> 4)]));
        sql.push(char::from(HEX[usize::from(b & 15)]));
    }
    sql.push_str("', 'hex')");
}

/// The size of what a complete stores, to size its statement.
fn outcome_len(outcome: &StoredOutcome) -> usize {
    match outcome {
        StoredOutcome::Response(r) => r.body.len(),
        StoredOutcome::Oversized { .. } => 0,
    }
}

/// Whether the server answered `e` with SQLSTATE `code`.
fn has_code(e: &sqlx::Error, code: &str) -> bool {
    e.as_database_error()
        .is_some_and(|d| d.code().as_deref() == Some(code))
}

/// A BEGIN batch failed: a database error leaves its transaction open and aborted on the
/// server (sqlx counts none), so it is rolled back here before the connection goes back to
/// the pool; a connection that answered nothing is closed instead.
async fn end_failed_batch(
    e: sqlx::Error,
    mut conn: sqlx::pool::PoolConnection<sqlx::Postgres>,
) -> StoreError {
    if matches!(e, sqlx::Error::Database(_)) {
        missing_functions(&e);
        let _ = roll_back_failed(conn).await;
    } else {
        conn.close_on_drop();
    }
    db_error(e)
}

/// Rolls back the failed transaction a batch left on `conn`, which sqlx does not count. If
/// that fails, or its future is dropped midway, the connection is closed, never returned to
/// the pool inside a transaction.
async fn roll_back_failed(
    conn: sqlx::pool::PoolConnection<sqlx::Postgres>,
) -> Result<sqlx::pool::PoolConnection<sqlx::Postgres>, sqlx::Error> {
    let mut guard = CloseIfCancelled::new(conn);
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut **guard.get())
        .await?;
    Ok(guard.disarm())
}

/// Says what to do when the store's functions (migration 3) are missing: the table was made
/// without [`PostgresStore::migrate`], or before this version.
fn missing_functions(e: &sqlx::Error) {
    if has_code(e, "42883") {
        tracing::error!(
            error = %e,
            "idempotency: the PostgreSQL store's functions are missing; run PostgresStore::migrate() (migration 3 adds them)"
        );
    }
}

/// Whether the server answered `e` with an ERROR, which ends the statement and the query it
/// is in but not the session (not FATAL or PANIC).
fn is_error_severity(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|d| d.try_downcast_ref::<sqlx::postgres::PgDatabaseError>())
        .is_some_and(|d| d.severity() == sqlx::postgres::PgSeverity::Error)
}

/// The store's functions (migration 3) are missing or not executable by this role.
#[derive(Debug, thiserror::Error)]
#[error(
    "the PostgreSQL store's functions for transactional mode are missing or not executable; run PostgresStore::migrate() (migration 3 adds them) and grant EXECUTE on them"
)]
struct MissingFunctions;
