//! What the SQL stores share: identifier checks, row decoding and the claim decision.

#[macro_use]
mod common;
#[cfg(feature = "mysql")]
pub(crate) mod mysql;
#[cfg(feature = "postgres")]
mod pg_listen;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
#[cfg(feature = "sqlite")]
pub(crate) mod sqlite;

use crate::store::StoreError;
pub(crate) use crate::store::row::{
    Decision, ExistingRow, RecordColumns, build_record, claimed, decide, from_millis, millis,
    outcome_columns,
};
use sqlx::{AssertSqlSafe, ColumnIndex, Decode, Row, SqlSafeStr, Type};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// How often a claim retries when a concurrent claimer or releaser changed the row between
/// its statements (each retry means someone else made progress).
pub(crate) const MAX_CLAIM_ATTEMPTS: usize = 16;

/// Why a SQL store could not be set up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SetupError {
    /// A table or schema name is not a plain SQL identifier.
    #[error(
        "`{0}` is not a valid identifier: use 1-48 lower-case ASCII letters, digits or `_`, not starting with a digit"
    )]
    InvalidIdentifier(String),
    /// Connecting or migrating failed.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// Running the store's migrations failed.
    #[error("migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
}

/// Checks a table or schema name (they are spliced into SQL, so only plain identifiers pass).
pub(crate) fn identifier(name: &str) -> Result<String, SetupError> {
    let ok = !name.is_empty()
        && name.len() <= 48
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        && !name.as_bytes()[0].is_ascii_digit();
    if ok {
        Ok(name.to_owned())
    } else {
        Err(SetupError::InvalidIdentifier(name.to_owned()))
    }
}

/// Every retry of a claim found the row changed under it.
#[derive(Debug, thiserror::Error)]
#[error("claim gave up after {MAX_CLAIM_ATTEMPTS} attempts under contention")]
pub(crate) struct Contention;

/// Statements a store has sent, for tests and diagnostics.
#[derive(Debug, Default)]
pub(crate) struct Counter(AtomicU64);

impl Counter {
    pub(crate) fn bump(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
    pub(crate) fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// The connections a SQL store's fenced writes (lease renewals, completes, releases) run
/// on: a pooled one, unless
/// - the engine asks for a fresh one ([`crate::store::wants_fresh_connection`]: the write
///   follows one it gave up on), or
/// - a fenced write of this store was abandoned (its future dropped before the database
///   answered) or could not reach the database in the last [`SUSPECT_FOR`]: the pool's idle
///   connections may have gone silent like that one (a NAT or proxy that forgot them all);
///
/// then it opens a connection of its own, outside the pool, so a pool whose connections went
/// silent (a half-open TCP connection keeps its place in the pool) or are all busy (long
/// transactional handlers) cannot hold up a renewal, or the complete that a retry waits for.
/// An abandoned write's pooled connection is closed, never returned to the pool, and its place
/// in the pool given back. While the pool is suspect each fenced write costs a connection's
/// set-up; claims and replays stay on the pool.
#[derive(Debug)]
pub(crate) struct FencedConns {
    /// Until when (ms after `since`) the pool is suspect: set by a write that was abandoned
    /// or did not reach the database.
    suspect_until: AtomicU64,
    since: tokio::time::Instant,
    /// Whether a connection opened with the pool's options reaches the same database (not an
    /// in-memory SQLite database, which lives in its pool's connection).
    fresh_reaches_pool: bool,
}

impl FencedConns {
    /// FencedConns on a pool where a new connection reaches the same database (or, with
    /// `false`, always on the pool).
    pub(crate) fn new(fresh_reaches_pool: bool) -> Self {
        FencedConns {
            suspect_until: AtomicU64::new(0),
            since: tokio::time::Instant::now(),
            fresh_reaches_pool,
        }
    }

    /// Milliseconds since this was made.
    fn now_ms(&self) -> u64 {
        u64::try_from(self.since.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Runs `work` (one fenced write) on a connection of `pool`, or on a fresh one (see the
    /// type).
    pub(crate) async fn run<DB: sqlx::Database, T>(
        &self,
        pool: &sqlx::Pool<DB>,
        work: impl AsyncFnOnce(&mut DB::Connection) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let mut held = FencedConnection::<DB> {
            conns: self,
            conn: None,
            answered: false,
        };
        // Fresh when the engine asks for it (the write follows one it gave up on), or while
        // the pool is suspect (see the type).
        let asked = crate::store::renew::wants_fresh_connection();
        let suspect = self.now_ms() < self.suspect_until.load(Ordering::Relaxed);
        let fresh = self.fresh_reaches_pool && (asked || suspect);
        let conn = if fresh {
            let options = pool.connect_options();
            let conn = <DB::Connection as sqlx::Connection>::connect_with(&options)
                .await
                .map_err(db_error)?;
            &mut **held.conn.insert(Either::Fresh(conn))
        } else {
            let conn = pool.acquire().await.map_err(db_error)?;
            &mut **held.conn.insert(Either::Pooled(conn))
        };
        let out = work(conn).await;
        held.answered = match &out {
            Ok(_) | Err(StoreError::StaleLease | StoreError::Corrupt(_)) => true,
            Err(StoreError::Unavailable(source)) => source
                .downcast_ref::<sqlx::Error>()
                .is_some_and(|e| e.as_database_error().is_some()),
            Err(_) => false,
        };
        out
    }
}

/// How long a pool stays suspect after one of its fenced writes was abandoned or could not
/// reach the database (see [`FencedConns`]).
pub(crate) const SUSPECT_FOR: Duration = Duration::from_secs(30);

/// A fenced write's connection, pooled or opened for it.
enum Either<DB: sqlx::Database> {
    Pooled(sqlx::pool::PoolConnection<DB>),
    Fresh(DB::Connection),
}

impl<DB: sqlx::Database> std::ops::Deref for Either<DB> {
    type Target = DB::Connection;
    fn deref(&self) -> &DB::Connection {
        match self {
            Either::Pooled(c) => c,
            Either::Fresh(c) => c,
        }
    }
}

impl<DB: sqlx::Database> std::ops::DerefMut for Either<DB> {
    fn deref_mut(&mut self) -> &mut DB::Connection {
        match self {
            Either::Pooled(c) => c,
            Either::Fresh(c) => c,
        }
    }
}

/// Settles a fenced write's connection when the write ends, answered or abandoned.
struct FencedConnection<'a, DB: sqlx::Database> {
    conns: &'a FencedConns,
    conn: Option<Either<DB>>,
    /// The database answered (a row, a refusal, an error of its own): the connection works.
    answered: bool,
}

impl<DB: sqlx::Database> Drop for FencedConnection<'_, DB> {
    fn drop(&mut self) {
        if !self.answered {
            // Abandoned (dropped before an answer) or the connection failed: the next write
            // opens a connection of its own, and this one is closed (dropping a connection
            // closes its socket; detached, its place in the pool is given back).
            let suspect = u64::try_from(SUSPECT_FOR.as_millis()).unwrap_or(u64::MAX);
            let until = self.conns.now_ms().saturating_add(suspect);
            self.conns.suspect_until.fetch_max(until, Ordering::Relaxed);
            if let Some(Either::Pooled(conn)) = self.conn.take() {
                drop(conn.detach());
            }
            return;
        }
        if let Some(Either::Fresh(conn)) = self.conn.take() {
            // Closed politely, in the background; a pooled one goes back to its pool.
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(async move {
                    let close = sqlx::Connection::close(conn);
                    let _ = tokio::time::timeout(Duration::from_secs(5), close).await;
                });
            }
        }
    }
}

/// A prepared statement's text as sqlx takes it (the text is built once, from checked
/// identifiers, at store construction).
pub(crate) fn q(sql: &Arc<str>) -> sqlx::SqlStr {
    AssertSqlSafe(Arc::clone(sql)).into_sql_str()
}

/// Maps a driver error to the store error the engine understands.
pub(crate) fn db_error(e: sqlx::Error) -> StoreError {
    match e {
        sqlx::Error::ColumnDecode { .. }
        | sqlx::Error::Decode(_)
        | sqlx::Error::ColumnNotFound(_) => StoreError::Corrupt(e.to_string()),
        // Connection loss, pool timeouts, busy/locked databases, I/O: all "unavailable".
        other => StoreError::unavailable(other),
    }
}

/// A fenced write's answer: one row changed, or the token no longer holds the record.
pub(crate) fn fenced(rows_affected: u64) -> Result<(), StoreError> {
    if rows_affected == 1 {
        Ok(())
    } else {
        Err(StoreError::StaleLease)
    }
}

/// Whether a store error is a database error with this SQLSTATE (`40001`, `55P03`, …).
pub(crate) fn has_sqlstate(error: &StoreError, code: &str) -> bool {
    let StoreError::Unavailable(source) = error else {
        return false;
    };
    source
        .downcast_ref::<sqlx::Error>()
        .and_then(|e| e.as_database_error())
        .and_then(|e| e.code())
        .is_some_and(|c| c == code)
}

/// Whether a statement failed for a serialization failure (40001) or a deadlock (40P01):
/// either leaves nothing written, and the statement may run again. Outside a transaction on
/// a PostgreSQL server whose default isolation is stricter than READ COMMITTED, a fenced
/// write can fail so against a concurrent statement on a neighbouring row.
pub(crate) fn is_serialization_failure(error: &StoreError) -> bool {
    has_sqlstate(error, "40001") || has_sqlstate(error, "40P01")
}

/// How often a fenced write that failed for a serialization failure runs again.
const CONFLICT_RETRIES: u32 = 8;

/// Whether to run a fenced write again after `error`: a serialization failure, fewer than
/// [`CONFLICT_RETRIES`] times (start `conflicts` at `u32::MAX` for never); waits a moment
/// (growing) first.
pub(crate) async fn again_after_conflict(error: &StoreError, conflicts: &mut u32) -> bool {
    if *conflicts >= CONFLICT_RETRIES || !is_serialization_failure(error) {
        return false;
    }
    *conflicts += 1;
    tokio::time::sleep(Duration::from_millis(u64::from(*conflicts))).await;
    true
}

/// Decodes the columns every claim statement reports for an existing row (any database whose
/// driver decodes these Rust types).
pub(crate) fn existing_row<'r, R>(row: &'r R) -> Result<ExistingRow, sqlx::Error>
where
    R: Row,
    for<'n> &'n str: ColumnIndex<R>,
    Vec<u8>: Decode<'r, R::Database> + Type<R::Database>,
    bool: Decode<'r, R::Database> + Type<R::Database>,
    uuid::Uuid: Decode<'r, R::Database> + Type<R::Database>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
    i32: Decode<'r, R::Database> + Type<R::Database>,
{
    Ok(ExistingRow {
        fingerprint: row.try_get("fingerprint")?,
        done: row.try_get("done")?,
        token: row.try_get("token")?,
        expired: row.try_get("expired")?,
        lease_over: row.try_get("lease_over")?,
        retry_ms: row.try_get("retry_ms")?,
        status: row.try_get("status")?,
        headers: row.try_get("headers")?,
        body: row.try_get("body")?,
        oversized: row.try_get("oversized")?,
    })
}

/// Decodes a whole row as `Store::get` reads it.
pub(crate) fn record_columns<'r, R>(row: &'r R) -> Result<RecordColumns, sqlx::Error>
where
    R: Row,
    for<'n> &'n str: ColumnIndex<R>,
    Vec<u8>: Decode<'r, R::Database> + Type<R::Database>,
    bool: Decode<'r, R::Database> + Type<R::Database>,
    uuid::Uuid: Decode<'r, R::Database> + Type<R::Database>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
    i32: Decode<'r, R::Database> + Type<R::Database>,
{
    Ok(RecordColumns {
        fingerprint: row.try_get("fingerprint")?,
        done: row.try_get("done")?,
        token: row.try_get("token")?,
        locked_until: row.try_get("locked_until")?,
        status: row.try_get("status")?,
        headers: row.try_get("headers")?,
        body: row.try_get("body")?,
        oversized: row.try_get("oversized")?,
        created_at: row.try_get("created_at")?,
        completed_at: row.try_get("completed_at")?,
        expires_at: row.try_get("expires_at")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fingerprint::Fingerprint;
    use crate::store::ClaimOutcome;
    use crate::store::fence::LeaseToken;
    use crate::store::record::{StoredOutcome, StoredResponse};
    use crate::store::row::stored_outcome;

    fn fp(byte: u8) -> Fingerprint {
        Fingerprint::from_parts(Fingerprint::VERSION, [byte; 32])
    }

    fn row(fingerprint: Fingerprint) -> ExistingRow {
        ExistingRow {
            fingerprint: fingerprint.to_stored().to_vec(),
            done: false,
            token: uuid::Uuid::from_u128(7),
            expired: false,
            lease_over: false,
            retry_ms: 1500,
            status: None,
            headers: None,
            body: None,
            oversized: None,
        }
    }

    fn done(mut r: ExistingRow) -> ExistingRow {
        r.done = true;
        r.status = Some(201);
        r.headers = Some(
            StoredResponse::new(201, "")
                .with_header("x", "1")
                .encode_headers(),
        );
        r.body = Some(b"ok".to_vec());
        r
    }

    #[test]
    fn decisions() {
        let old = LeaseToken::from_uuid(uuid::Uuid::from_u128(7));
        let take = |r, f: &Fingerprint| match decide(r, f).unwrap() {
            Decision::TakeOver(t) => t,
            Decision::Report(o, _) => panic!("{o:?}"),
        };
        let report = |r, f: &Fingerprint| match decide(r, f).unwrap() {
            Decision::Report(o, _) => o,
            Decision::TakeOver(_) => panic!("take over"),
        };
        // Expired: absent, whatever its fingerprint or state.
        let mut expired = done(row(fp(1)));
        expired.expired = true;
        assert_eq!(take(expired, &fp(2)), old);
        // Another request: mismatch, done or in progress alike, even with a run-out lease.
        assert_eq!(
            report(done(row(fp(1))), &fp(2)),
            ClaimOutcome::Mismatch { in_progress: false }
        );
        let mut over = row(fp(1));
        over.lease_over = true;
        assert_eq!(
            report(over, &fp(2)),
            ClaimOutcome::Mismatch { in_progress: true }
        );
        // Same request: replay, in progress (with the remaining lease), or take over.
        match report(done(row(fp(1))), &fp(1)) {
            ClaimOutcome::Replay(StoredOutcome::Response(r)) => {
                assert_eq!((r.status, r.body.as_slice()), (201, &b"ok"[..]));
                assert_eq!(r.headers, vec![("x".to_owned(), b"1".to_vec())]);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            report(row(fp(1)), &fp(1)),
            ClaimOutcome::InProgress {
                retry_after: Duration::from_millis(1500)
            }
        );
        let mut over = row(fp(1));
        over.lease_over = true;
        assert_eq!(take(over, &fp(1)), old);
        // A record of another fingerprint version is matched by key alone: its digest cannot
        // be compared with this version's, and a retry after an upgrade must not get 422.
        let v1 = Fingerprint::from_stored(&[1; 32]).unwrap();
        assert!(matches!(
            report(done(row(v1)), &fp(2)),
            ClaimOutcome::Replay(_)
        ));
        // Undecodable rows are corrupt, not a mismatch or a replay.
        let mut bad = row(fp(1));
        bad.fingerprint = vec![1, 2, 3];
        assert!(matches!(decide(bad, &fp(1)), Err(StoreError::Corrupt(_))));
        let mut bad = done(row(fp(1)));
        bad.status = None;
        assert!(matches!(decide(bad, &fp(1)), Err(StoreError::Corrupt(_))));
    }

    #[test]
    fn millis_round_up() {
        assert_eq!(millis(Duration::from_micros(500)), 1);
        assert_eq!(millis(Duration::from_millis(1500)), 1500);
        assert_eq!(millis(Duration::from_nanos(1_000_001)), 2);
        assert_eq!(millis(Duration::MAX), i64::MAX);
    }

    #[test]
    fn outcome_columns_round_trip() {
        for outcome in [
            StoredOutcome::Response(
                StoredResponse::new(201, vec![0, 255])
                    .with_header("a", "1")
                    .with_header("a", "2"),
            ),
            StoredOutcome::Oversized {
                status: 200,
                size: 1 << 30,
            },
        ] {
            let c = outcome_columns(&outcome);
            assert_eq!(
                stored_outcome(Some(c.status), c.headers, c.body, c.oversized).unwrap(),
                outcome
            );
        }
    }

    #[test]
    fn identifiers() {
        assert!(identifier("idempotency_records").is_ok());
        assert!(identifier("t1").is_ok());
        for bad in ["", "1t", "T1", "a-b", "a;drop", "\"x\"", &"x".repeat(49)] {
            assert!(identifier(bad).is_err(), "{bad}");
        }
    }
}
