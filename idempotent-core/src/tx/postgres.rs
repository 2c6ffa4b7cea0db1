//! Transactional mode on PostgreSQL: how the PostgreSQL store opens a handler's transaction
//! (READ COMMITTED, an idle timeout) and claims and completes inside it, with an advisory lock
//! standing for a key's uncommitted claim.

use super::{CommitPath, TxDatabase};
use crate::PostgresStore;
use crate::store::fence::LeaseToken;
use crate::store::record::{RecordKey, StoredOutcome};
use crate::store::sql::postgres::claim_query;
use crate::store::sql::{
    Contention, Decision, MAX_CLAIM_ATTEMPTS, claimed, db_error, fenced, millis,
};
use crate::store::{ClaimOutcome, ClaimRequest, StoreError};
use sqlx::postgres::PgConnection;
use sqlx::{AssertSqlSafe, Row, SqlSafeStr};

impl TxDatabase for sqlx::Postgres {
    type Store = PostgresStore;
    const LABEL: &'static str = "PostgreSQL";
    const DEFAULT_COMMIT: CommitPath = CommitPath::Single;

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
    ) -> Result<sqlx::Transaction<'static, sqlx::Postgres>, StoreError> {
        let begin = match idle {
            Some(idle) => {
                // The server's limit for this setting is i32::MAX ms (about 24.8 days).
                let ms = millis(idle).clamp(1, i64::from(i32::MAX));
                format!(
                    "BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL idle_in_transaction_session_timeout = {ms}"
                )
            }
            None => "BEGIN ISOLATION LEVEL READ COMMITTED".to_owned(),
        };
        let conn = match conn {
            Some(conn) => conn,
            None => store.pool.acquire().await.map_err(db_error)?,
        };
        // What `Pool::begin_with` does, on a connection already held.
        sqlx::Transaction::begin(conn, Some(AssertSqlSafe(begin).into_sql_str()))
            .await
            .map_err(db_error)
    }

    async fn acquire(
        store: &PostgresStore,
    ) -> Result<sqlx::pool::PoolConnection<sqlx::Postgres>, StoreError> {
        store.pool.acquire().await.map_err(db_error)
    }

    async fn read<'a>(
        store: &'a PostgresStore,
        conn: &'a mut PgConnection,
        req: ClaimRequest<'a>,
    ) -> Result<Option<ClaimOutcome>, StoreError> {
        store.read_settled(conn, &req).await
    }

    async fn claim_in(
        store: &PostgresStore,
        conn: &mut PgConnection,
        req: ClaimRequest<'_>,
    ) -> Result<Option<ClaimOutcome>, StoreError> {
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
                Decision::Report(outcome) => return Ok(Some(outcome)),
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

    async fn complete_in(
        store: &PostgresStore,
        conn: &mut PgConnection,
        key: &RecordKey,
        token: LeaseToken,
        outcome: &StoredOutcome,
        ttl: std::time::Duration,
        idle: std::time::Duration,
    ) -> Result<(), StoreError> {
        // The server's limit for this setting is i32::MAX ms (about 24.8 days).
        let idle_ms = millis(idle).clamp(1, i64::from(i32::MAX));
        let done = store
            .complete_query(&store.sql.tx_complete, key, token, outcome, ttl)
            .bind(idle_ms.to_string())
            .execute(&mut *conn)
            .await
            .map_err(db_error)?;
        fenced(done.rows_affected())
    }

    /// The lease, and at least 10 s: past it the server has ended a session that stalled
    /// idle (the bound the complete set), so no answer is coming; the floor keeps a COMMIT
    /// that is merely slow (a loaded disk) from being given up on.
    fn finish_bound(lease: std::time::Duration) -> Option<std::time::Duration> {
        Some(lease.max(std::time::Duration::from_secs(10)))
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
