//! The transaction a transactional handler writes through, and the databases whose stores
//! provide it.

use super::held::Held;
use crate::store::fence::LeaseToken;
use crate::store::record::{RecordKey, StoredOutcome};
use crate::store::{ClaimOutcome, ClaimRequest, Store, StoreError};
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

pub(super) type Home<DB> = Arc<Mutex<Option<Held<DB>>>>;

pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The transaction a transactional handler writes through: a live sqlx transaction on the
/// store's own database, dereferencing to its connection, so statements run as
/// `query.execute(&mut *tx)`.
///
/// The library commits it (with the stored response) or rolls it back after the handler
/// returns; there is no `commit` here. Keep it inside the handler: a transaction still
/// held elsewhere when the handler returns cannot be committed, so the request is answered
/// with a 500 problem and everything it wrote rolls back.
///
/// ```no_run
/// # async fn demo(mut tx: idempotent_core::Transaction<sqlx::Postgres>) -> Result<(), sqlx::Error> {
/// sqlx::query("INSERT INTO orders (id) VALUES ($1)")
///     .bind("ord_1")
///     .execute(&mut *tx)
///     .await?;
/// # Ok(()) }
/// ```
pub struct Transaction<DB: sqlx::Database> {
    pub(super) tx: Option<Held<DB>>,
    pub(super) home: Home<DB>,
}

impl<DB: sqlx::Database> std::fmt::Debug for Transaction<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transaction")
            .field("database", &DB::NAME)
            .finish_non_exhaustive()
    }
}

impl<DB: sqlx::Database> std::ops::Deref for Transaction<DB> {
    type Target = DB::Connection;
    fn deref(&self) -> &DB::Connection {
        self.tx
            .as_ref()
            .expect("the transaction is held until drop")
    }
}

impl<DB: sqlx::Database> std::ops::DerefMut for Transaction<DB> {
    fn deref_mut(&mut self) -> &mut DB::Connection {
        self.tx
            .as_mut()
            .expect("the transaction is held until drop")
    }
}

impl<DB: sqlx::Database> Drop for Transaction<DB> {
    fn drop(&mut self) {
        // Hand it back to the execution, which commits or rolls back.
        if let Some(tx) = self.tx.take() {
            *lock(&self.home) = Some(tx);
        }
    }
}

/// What reading a record before a transactional claim found.
#[doc(hidden)]
#[derive(Debug)]
pub enum ReadFirst {
    /// The row settles the request (replay, in progress, mismatch); for a replay, how long the
    /// record still lives (as [`Store::claim_with_expiry`](crate::Store::claim_with_expiry)
    /// reports it).
    Settled(ClaimOutcome, Option<std::time::Duration>),
    /// No row: the claim will most likely insert one.
    Absent,
    /// A row whose lease or ttl ran out: the claim takes it over.
    Stale,
    /// No committed row, but another open transaction holds the key (PostgreSQL: a first
    /// attempt is running): the ordinary claim waits for it, bounded.
    Held,
}

/// What [`TxDatabase::claim_first`] did.
#[doc(hidden)]
pub enum FirstClaim<DB: sqlx::Database> {
    /// Claimed inside the new transaction, under this token.
    Claimed(Held<DB>, LeaseToken),
    /// Not claimed; no transaction open on the connection.
    Fallback(sqlx::pool::PoolConnection<DB>),
}

/// How [`TxDatabase::complete_commit`] failed.
#[doc(hidden)]
pub enum FinishError<DB: sqlx::Database> {
    /// The complete failed (the fence refused, or the transaction was aborted): nothing
    /// committed, and the transaction is still to be rolled back.
    Complete(StoreError, Held<DB>),
    /// COMMIT failed or did not answer: whether it applied is unknown.
    Commit(StoreError),
}

mod sealed {
    pub trait Sealed {}
}
#[cfg(feature = "postgres")]
impl sealed::Sealed for sqlx::Postgres {}
#[cfg(feature = "sqlite")]
impl sealed::Sealed for sqlx::Sqlite {}
#[cfg(feature = "mysql")]
impl sealed::Sealed for sqlx::MySql {}

/// A database whose store runs transactional executions: `sqlx::Postgres`
/// ([`PostgresStore`](crate::PostgresStore)), `sqlx::MySql`
/// ([`MySqlStore`](crate::MySqlStore), MySQL and MariaDB) and `sqlx::Sqlite`
/// ([`SqliteStore`](crate::SqliteStore)). Sealed.
pub trait TxDatabase: sqlx::Database + sealed::Sealed {
    /// The store on this database.
    type Store: Store + Clone + std::fmt::Debug;
    /// The database's name, for errors.
    const LABEL: &'static str;
    /// Whether single commit reads the record first whatever
    /// [`TxOptions::read_first`](super::TxOptions::read_first) says (SQLite: a claim inside a
    /// transaction holds the one write lock, which a replay must not wait for).
    const ALWAYS_READ_FIRST: bool;

    /// Opens a transaction for a handler, on `conn` if given (the connection the read
    /// ran on: no trip back to the pool in between, so no release ping either) or on a
    /// connection from the store's pool; with `idle` (single commit: the lease),
    /// PostgreSQL ends it if it stays idle (no statement) that long.
    #[doc(hidden)]
    fn begin_tx(
        store: &Self::Store,
        idle: Option<Duration>,
        conn: Option<sqlx::pool::PoolConnection<Self>>,
    ) -> impl Future<Output = Result<Held<Self>, StoreError>> + Send;

    /// Single commit after a read that found no record: opens the transaction and claims
    /// in it together where the database allows (PostgreSQL: one round trip). `Fallback`
    /// gives the connection back, with no transaction open, when that did not claim (the
    /// key was taken meanwhile, or this database has no such path): the caller goes on with
    /// [`begin_tx`](Self::begin_tx) and [`claim_in`](Self::claim_in), which settle every case.
    #[doc(hidden)]
    fn claim_first(
        store: &Self::Store,
        conn: sqlx::pool::PoolConnection<Self>,
        idle: Duration,
        req: ClaimRequest<'_>,
    ) -> impl Future<Output = Result<FirstClaim<Self>, StoreError>> + Send {
        let _ = (store, idle, req);
        std::future::ready(Ok(FirstClaim::Fallback(conn)))
    }

    /// Checks, before a handler runs, that the store has what transactional executions call
    /// (PostgreSQL: the functions of its migration 3, checked once per store until found).
    #[doc(hidden)]
    fn ready(store: &Self::Store) -> impl Future<Output = Result<(), StoreError>> + Send {
        let _ = store;
        std::future::ready(Ok(()))
    }

    /// A connection from the store's pool.
    #[doc(hidden)]
    fn acquire(
        store: &Self::Store,
    ) -> impl Future<Output = Result<sqlx::pool::PoolConnection<Self>, StoreError>> + Send;

    /// Reads the record on `conn`, outside any transaction: whether that settles the
    /// request (replay, in progress, mismatch) or a claim must follow.
    #[doc(hidden)]
    fn read<'a>(
        store: &'a Self::Store,
        conn: &'a mut Self::Connection,
        req: ClaimRequest<'a>,
    ) -> impl Future<Output = Result<ReadFirst, StoreError>> + Send + 'a;

    /// Claims inside the transaction (single commit). `None`: another open transaction
    /// holds the key (PostgreSQL's advisory lock, MySQL's named lock); the caller may wait
    /// and call again.
    #[doc(hidden)]
    fn claim_in(
        store: &Self::Store,
        tx: &mut Held<Self>,
        req: ClaimRequest<'_>,
    ) -> impl Future<Output = Result<Option<ClaimOutcome>, StoreError>> + Send;

    /// Commits the transaction (and runs what must follow its end on the session).
    #[doc(hidden)]
    fn commit_tx(tx: Held<Self>) -> impl Future<Output = Result<(), sqlx::Error>> + Send {
        tx.commit()
    }

    /// Rolls the transaction back (and runs what must follow its end on the session).
    #[doc(hidden)]
    fn rollback_tx(tx: Held<Self>) -> impl Future<Output = Result<(), sqlx::Error>> + Send {
        tx.rollback()
    }

    /// Completes the record inside the transaction, fenced by `token`, and commits: in one
    /// round trip where the database allows (PostgreSQL), else one after the other. Between
    /// the two the transaction holds the record's row; PostgreSQL sends both at once, so no
    /// stalled process can hold it there.
    #[doc(hidden)]
    fn complete_commit(
        store: &Self::Store,
        tx: Held<Self>,
        key: &RecordKey,
        token: LeaseToken,
        outcome: &StoredOutcome,
        ttl: Duration,
    ) -> impl Future<Output = Result<(), FinishError<Self>>> + Send;

    /// How long the library waits for the complete and for COMMIT to answer before it
    /// gives up on them (answers 503; the connection goes back to sqlx's pool, which tests
    /// it with no bound of its own: a connection whose peer went silent holds its pool
    /// slot until the operating system reports the socket dead), given the route's
    /// lease; `None`: no bound (SQLite: a local file, whose busy timeout bounds waits).
    #[doc(hidden)]
    fn finish_bound(lease: Duration) -> Option<Duration>;

    /// How long a handler's transaction may stay open, given the route's lease and whether
    /// it holds the database's write lock from its start (single commit); `None`: no bound of
    /// the library's (PostgreSQL and MySQL end an idle single-commit transaction at the lease
    /// themselves, and a two-commit one is held by its heartbeat). SQLite has no idle limit,
    /// and its open write transaction holds up every writer on the file, other executions'
    /// lease renewals included: its handlers get the lease, and at most the store's
    /// `max_transaction` when they hold the lock from the start.
    #[doc(hidden)]
    fn run_bound(store: &Self::Store, holds_lock: bool, lease: Duration) -> Option<Duration> {
        let _ = (store, holds_lock, lease);
        None
    }
}
