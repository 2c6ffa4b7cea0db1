//! Transactional mode on SQLite: how the SQLite store opens a handler's transaction and
//! claims and completes inside it.

use super::held::Held;
use super::{FinishError, ReadFirst, TxDatabase};
use crate::store::SqliteStore;
use crate::store::fence::LeaseToken;
use crate::store::record::{RecordKey, StoredOutcome};
use crate::store::sql::{Decision, db_error, q};
use crate::store::{ClaimOutcome, ClaimRequest, StoreError};
use sqlx::SqlSafeStr;
use sqlx::sqlite::SqliteConnection;
use std::time::Duration;

impl TxDatabase for sqlx::Sqlite {
    type Store = SqliteStore;
    const LABEL: &'static str = "SQLite";
    /// A claim inside a transaction takes SQLite's one write lock: replays must not.
    const ALWAYS_READ_FIRST: bool = true;

    /// Single commit (`idle` given): `BEGIN IMMEDIATE`, the write lock from the start: the
    /// claim inside the transaction writes first, and a read followed by a write then never
    /// fails on a snapshot another writer moved. With the store's queue
    /// ([`queue_transactions`](crate::store::SqliteStoreBuilder::queue_transactions)), waits
    /// first for its turn, in arrival order, then for the lock itself up to the busy timeout,
    /// which any writer outside the queue may hold.
    ///
    /// Two commits, and a transaction with no record (`idle` not given): a deferred `BEGIN`,
    /// which takes the write lock only at the transaction's first write (the handler's, or the
    /// complete at its end), so a handler that works before it writes does not hold up every
    /// other writer on the file, other executions' lease renewals included, while it works.
    /// Such a transaction takes the lock in SQLite's busy handler, like any writer outside the
    /// queue. A handler that reads, then writes after any other connection committed meanwhile,
    /// gets `SQLITE_BUSY` (its snapshot is stale) at that write, and its own lease's renewal
    /// commits every half lease: a handler that reads, works half a lease, then writes, fails
    /// that way every time. Write before the slow part (or read again just before writing),
    /// or use single commit, whose transaction holds the lock (and one snapshot) from its
    /// start.
    async fn begin_tx(
        store: &SqliteStore,
        idle: Option<Duration>,
        conn: Option<sqlx::pool::PoolConnection<sqlx::Sqlite>>,
    ) -> Result<Held<sqlx::Sqlite>, StoreError> {
        let conn = match conn {
            Some(conn) => conn,
            None => store.pool.acquire().await.map_err(db_error)?,
        };
        let immediate = idle.is_some();
        // The connection before the turn, always: a turn's holder then never waits for a
        // connection that a request waiting for the turn holds (one that ran the read does).
        let turn = if immediate {
            store.writes.turn().await
        } else {
            None
        };
        let begin = if immediate {
            "BEGIN IMMEDIATE"
        } else {
            "BEGIN"
        };
        // What `Pool::begin_with` does, on a connection already held. (A failed BEGIN
        // leaves no transaction open.)
        let mut tx = Held::begin(conn, begin.into_sql_str())
            .await
            .map_err(|(e, _)| db_error(e))?;
        tx.turn = turn;
        Ok(tx)
    }

    async fn acquire(
        store: &SqliteStore,
    ) -> Result<sqlx::pool::PoolConnection<sqlx::Sqlite>, StoreError> {
        store.pool.acquire().await.map_err(db_error)
    }

    async fn read<'a>(
        store: &'a SqliteStore,
        conn: &'a mut SqliteConnection,
        req: ClaimRequest<'a>,
    ) -> Result<ReadFirst, StoreError> {
        store.sent.bump();
        let row = sqlx::query(q(&store.sql.read))
            .bind(req.key.scope.as_str())
            .bind(req.key.key.as_str())
            .fetch_optional(&mut *conn)
            .await
            .map_err(db_error)?;
        let Some(row) = row else {
            return Ok(ReadFirst::Absent);
        };
        match SqliteStore::decide_row(&row, &req)? {
            Decision::Report(outcome, lives) => Ok(ReadFirst::Settled(outcome, lives)),
            Decision::TakeOver(_) => Ok(ReadFirst::Stale),
        }
    }

    /// The transaction holds the write lock, so the ordinary claim cannot race.
    async fn claim_in(
        store: &SqliteStore,
        tx: &mut Held<sqlx::Sqlite>,
        req: ClaimRequest<'_>,
    ) -> Result<Option<ClaimOutcome>, StoreError> {
        store.claim_on(tx, req).await.map(Some)
    }

    async fn complete_commit(
        store: &SqliteStore,
        tx: Held<sqlx::Sqlite>,
        key: &RecordKey,
        token: LeaseToken,
        outcome: &StoredOutcome,
        ttl: Duration,
    ) -> Result<(), FinishError<sqlx::Sqlite>> {
        let mut tx = tx;
        if let Err(error) = store.complete_on(&mut tx, key, token, outcome, ttl).await {
            return Err(FinishError::Complete(error, tx));
        }
        tx.commit()
            .await
            .map_err(|e| FinishError::Commit(db_error(e)))
    }

    fn finish_bound(_lease: Duration) -> Option<Duration> {
        None
    }

    /// The lease, and for a transaction that holds the write lock from its start (single
    /// commit) at most the store's `max_transaction`: SQLite has no idle limit, and an open
    /// write transaction holds up every writer on the file.
    fn run_bound(store: &SqliteStore, holds_lock: bool, lease: Duration) -> Option<Duration> {
        Some(if holds_lock {
            lease.min(store.max_transaction)
        } else {
            lease
        })
    }
}
