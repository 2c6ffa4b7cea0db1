//! The SQLite store.

use super::{
    Contention, Counter, Decision, MAX_CLAIM_ATTEMPTS, SetupError, claimed, db_error, identifier, q,
};
use crate::store::fence::LeaseToken;
use crate::store::{ClaimOutcome, ClaimRequest, StoreError};
use sqlx::migrate::{Migration, MigrationType, Migrator};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
};
use sqlx::{AssertSqlSafe, SqlSafeStr};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

/// SQLite's clock, in integer milliseconds since the Unix epoch.
const NOW: &str = "CAST(unixepoch('subsec') * 1000 AS INTEGER)";

/// How long a statement waits for another connection's (or process's) write lock.
pub const DEFAULT_BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// A store in a SQLite database: the embedded default, shared safely by several processes
/// on one database file.
///
/// [`SqliteStore::connect`] opens the file in WAL mode with a busy timeout, so concurrent
/// writers wait rather than fail. Times come from SQLite's clock (`unixepoch('subsec')`).
///
/// A process that is the file's only writer can have its transactional executions take the
/// write lock in arrival order ([`SqliteStoreBuilder::queue_transactions`]), which cuts the
/// slowest requests' wait under load.
///
/// ```
/// use idempotent_core::SqliteStore;
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let store = SqliteStore::connect("sqlite::memory:").await?;
/// store.migrate().await?;
/// # Ok(()) }
/// ```
///
/// # Round trips
/// A replay is one `SELECT` (no write lock taken). A first execution is that `SELECT`, an
/// `INSERT … ON CONFLICT DO NOTHING RETURNING` (the atomic claim) and the `UPDATE` that
/// completes it. The read never decides to insert: the `INSERT` alone settles races, so a
/// concurrent claimer that inserted first is seen, never overwritten.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    pub(crate) pool: SqlitePool,
    pub(crate) sql: Arc<Statements>,
    pub(crate) sent: Arc<Counter>,
    /// Transactional executions' turns at the write lock, if queued (see [`WriteQueue`]).
    pub(crate) writes: WriteQueue,
    /// The connections fenced writes (renewals, completes, releases) run on.
    pub(crate) fenced: Arc<super::FencedConns>,
    /// The longest a single-commit transactional handler may run
    /// ([`SqliteStoreBuilder::max_transaction`]).
    pub(crate) max_transaction: Duration,
    /// Wakes requests waiting on a record: in process (the engines over this store), and
    /// every 250 ms at most for answers from other processes on the file (SQLite has no
    /// notifications).
    pub(crate) changes: crate::store::Changes,
}

/// The order in which this process's transactional executions take SQLite's one write lock,
/// when the store was built with [`SqliteStoreBuilder::queue_transactions`]: a semaphore of
/// one permit (first come, first served), taken after the connection and before `BEGIN
/// IMMEDIATE`, given back when the transaction is dropped. Only an order: SQLite's lock still
/// decides, against every writer outside the queue.
#[derive(Debug, Clone)]
pub(crate) struct WriteQueue(Option<(Arc<tokio::sync::Semaphore>, Duration)>);

impl WriteQueue {
    /// Waits for this transaction's turn: `None` when there is no queue, or after the wait
    /// it was built with (the transaction then goes on without one, and SQLite's busy
    /// timeout decides, so a turn's holder that waits on another request's transaction in
    /// this process never waits for ever).
    pub(crate) async fn turn(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        let (permits, wait) = self.0.as_ref()?;
        if let Ok(permit) = Arc::clone(permits).try_acquire_owned() {
            return Some(permit);
        }
        tokio::time::timeout(*wait, Arc::clone(permits).acquire_owned())
            .await
            .ok()?
            .ok()
    }
}

/// Builds a [`SqliteStore`] on a pool.
#[derive(Debug)]
pub struct SqliteStoreBuilder {
    pool: SqlitePool,
    table: String,
    clock: Option<String>,
    queue: Option<Duration>,
    max_transaction: Duration,
    change_poll: std::time::Duration,
}

impl SqliteStoreBuilder {
    /// The longest a request waiting for a running duplicate's answer (a route's `wait`) goes
    /// without looking at the store again, when no notification woke it (default 250 ms;
    /// waiters in this process are woken at once; one in another process on the file finds the answer by looking again, first after 20 ms, then at doubling pauses up to this). At least 10 ms.
    #[must_use]
    pub fn change_poll(mut self, every: std::time::Duration) -> Self {
        self.change_poll = every.max(std::time::Duration::from_millis(10));
        self
    }

    /// The table's name (default `idempotency_records`).
    #[must_use]
    pub fn table(mut self, table: &str) -> Self {
        table.clone_into(&mut self.table);
        self
    }

    /// For deterministic tests only, and not covered by semver: the SQL expression every
    /// statement reads the time from, in whole milliseconds since the Unix epoch, instead of
    /// SQLite's clock (`CAST(unixepoch('subsec') * 1000 AS INTEGER)`). A simulation that
    /// sets the time itself passes a read of a table it keeps, such as
    /// `(SELECT ms FROM sim_clock)`. The expression is written into the statements as given.
    #[doc(hidden)]
    #[must_use]
    pub fn clock_sql(mut self, expression: &str) -> Self {
        self.clock = Some(expression.to_owned());
        self
    }

    /// Off by default. Transactional executions through this store (and its clones) take
    /// SQLite's write lock in the order they asked for it: each waits for its turn in a queue
    /// in this process, for at most `wait`, before `BEGIN IMMEDIATE`.
    ///
    /// Without the queue, a transaction that finds the lock taken waits in SQLite's busy
    /// handler, which sleeps between tries (1, 2, 5, 10 ms, growing to 100 ms), so a lock let
    /// go is taken by whoever tries next, often a request that has just arrived, while one
    /// that has waited long sleeps on. Under load the slowest requests wait much longer:
    /// measured with `bench-http` (64 connections, single commit), p99 100–127 ms without the
    /// queue and 27–41 ms with it, at the same throughput (BENCHMARKS.md).
    ///
    /// For a database file that only this process writes to. Only this store's transactional
    /// executions queue. Every other writer still waits in the busy handler: everything this
    /// store writes outside a transactional execution (plain-mode claims and completes,
    /// two-commit routes' claims, heartbeats and releases, the sweeper's purges), other
    /// stores and processes on the file, the application's own connections. While the queue
    /// is never empty they seldom find the lock free, and under sustained load they can wait
    /// until their busy timeout.
    ///
    /// A request that waited `wait` for its turn then waits up to the busy timeout for the
    /// lock itself, so its longest wait is the two together: on routes with two commits, keep
    /// that under half their lease (the claim's lease is not renewed before the transaction
    /// has begun). `wait` is also how long a handler that awaits another request's
    /// transaction in this process (which queues behind it) waits before that request goes
    /// on without a turn: keep it short enough to be an error, not a hang.
    ///
    /// ```
    /// use idempotent_core::SqliteStore;
    /// use std::time::Duration;
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let pool = SqliteStore::connect("sqlite::memory:").await?.pool().clone();
    /// let store = SqliteStore::builder(pool)
    ///     .queue_transactions(Duration::from_secs(5))
    ///     .build()?;
    /// store.migrate().await?;
    /// # Ok(()) }
    /// ```
    #[must_use]
    pub fn queue_transactions(mut self, wait: Duration) -> Self {
        self.queue = Some(wait);
        self
    }

    /// The longest a single-commit transactional handler on this store may run (default
    /// [`DEFAULT_BUSY_TIMEOUT`], 5 s): its transaction holds the file's one write lock from its
    /// claim to its commit, and every other writer waits for it, other executions' lease
    /// renewals included, so the library stops and rolls back a handler still running then
    /// (503; a retry runs it again), or at the end of its own lease if that comes first. Past
    /// the busy timeout the other writers are failing anyway. For the renewals of every route
    /// on the file to get through, keep each route's lease at least four times this (the
    /// default lease, 30 s, is six times the default). Two-commit transactions take the lock
    /// only at their first write and are bounded by their lease alone.
    #[must_use]
    pub fn max_transaction(mut self, max: Duration) -> Self {
        self.max_transaction = max;
        self
    }

    /// Checks the name and prepares the statements.
    ///
    /// # Errors
    /// [`SetupError::InvalidIdentifier`] for a table name that is not `[a-z_][a-z0-9_]*`.
    pub fn build(self) -> Result<SqliteStore, SetupError> {
        let table = identifier(&self.table)?;
        let now = self.clock.as_deref().unwrap_or(NOW);
        // A new connection reaches the pool's database only when that is a file (an
        // in-memory database lives in its pool's connection, or in a shared cache whose
        // locking differs).
        let file = self.pool.connect_options().get_filename().is_file();
        Ok(SqliteStore {
            pool: self.pool,
            sql: Arc::new(Statements::new(&table, now)),
            sent: Arc::default(),
            fenced: Arc::new(super::FencedConns::new(file)),
            max_transaction: self.max_transaction,
            writes: WriteQueue(
                self.queue
                    .map(|wait| (Arc::new(tokio::sync::Semaphore::new(1)), wait)),
            ),
            changes: crate::store::Changes::in_process(self.change_poll),
        })
    }
}

#[derive(Debug)]
pub(crate) struct Statements {
    table: String,
    pub(crate) read: Arc<str>,
    insert: Arc<str>,
    take_over: Arc<str>,
    complete: Arc<str>,
    release: Arc<str>,
    extend: Arc<str>,
    purge: Arc<str>,
    get: Arc<str>,
    delete: Arc<str>,
}

impl Statements {
    fn new(table: &str, now: &str) -> Self {
        let s = |sql: &str| -> Arc<str> { sql.replace("{t}", table).replace("{now}", now).into() };
        Statements {
            table: table.to_owned(),
            // Read-only fast path: settles replays, in-progress and mismatch without taking
            // the write lock. It never decides to insert; a miss goes to `insert`.
            read: s("SELECT fingerprint, done, token,
                    expires_at <= {now} AS expired,
                    (done = 0 AND locked_until <= {now}) AS lease_over,
                    max(0, coalesce(coalesce(locked_until, expires_at) - {now}, 0)) AS retry_ms,
                    status, headers, body, oversized
                FROM {t} WHERE scope = ?1 AND key = ?2"),
            // The claim itself: one atomic statement, so of N concurrent claimers (threads or
            // processes) exactly one inserts; the others get no row and read the winner's.
            insert: s("INSERT INTO {t} (scope, key, fingerprint, done, token, locked_until, created_at, expires_at)
                VALUES (?1, ?2, ?3, 0, ?4, {now} + ?5, {now}, {now} + ?6)
                ON CONFLICT (scope, key) DO NOTHING
                RETURNING locked_until"),
            // Rare path: take over an expired record or a run-out lease (the caller checked the
            // fingerprint on the row it read); compare-and-swap on the old token so only one of
            // two racing retries wins (an unchanged token means an unchanged fingerprint).
            take_over: s("UPDATE {t} SET fingerprint = ?3, done = 0, token = ?4,
                    locked_until = {now} + ?5, created_at = {now}, completed_at = NULL,
                    status = NULL, headers = NULL, body = NULL, oversized = NULL,
                    expires_at = {now} + ?6
                WHERE scope = ?1 AND key = ?2 AND token = ?7
                  AND (expires_at <= {now} OR (done = 0 AND locked_until <= {now}))
                RETURNING locked_until"),
            // Fenced: a stale owner (lease taken over) matches no row and cannot overwrite.
            complete: s("UPDATE {t} SET done = 1, status = ?4, headers = ?5, body = ?6, oversized = ?7,
                    completed_at = {now}, locked_until = NULL, expires_at = max(expires_at, {now} + ?8)
                WHERE scope = ?1 AND key = ?2 AND token = ?3 AND done = 0 AND expires_at > {now}"),
            // Fenced like complete.
            release: s("DELETE FROM {t}
                WHERE scope = ?1 AND key = ?2 AND token = ?3 AND done = 0 AND expires_at > {now}"),
            // Fenced heartbeat; keeps the record alive at least as long as its lease.
            extend: s("UPDATE {t} SET locked_until = {now} + ?4, expires_at = max(expires_at, {now} + ?4)
                WHERE scope = ?1 AND key = ?2 AND token = ?3 AND done = 0 AND expires_at > {now}
                RETURNING locked_until"),
            // Bounded batch through the expiry index; each batch is its own short write.
            purge: s("DELETE FROM {t} WHERE rowid IN (
                    SELECT rowid FROM {t} WHERE expires_at <= {now} LIMIT ?1)"),
            get: s("SELECT fingerprint, done, token, locked_until, status, headers, body, oversized,
                    created_at, completed_at, expires_at
                FROM {t} WHERE scope = ?1 AND key = ?2 AND expires_at > {now}"),
            // Done, expired, or forced: an in-progress record under its ttl needs `force`.
            delete: s("DELETE FROM {t} WHERE scope = ?1 AND key = ?2
                    AND (done = 1 OR expires_at <= {now} OR ?3)
                RETURNING fingerprint, done, token, locked_until, status, headers, body, oversized,
                    created_at, completed_at, expires_at"),
        }
    }
}

impl SqliteStore {
    /// The complete statement (the same every time here; PostgreSQL's depends on its table).
    async fn complete_sql(&self) -> Arc<str> {
        Arc::clone(&self.sql.complete)
    }

    /// The release statement (see [`Self::complete_sql`]).
    async fn release_sql(&self) -> Arc<str> {
        Arc::clone(&self.sql.release)
    }

    /// Opens (creating if missing) the database at `url` (`sqlite://charges.db`,
    /// `sqlite::memory:`) in WAL mode with a busy timeout of [`DEFAULT_BUSY_TIMEOUT`], on a
    /// pool that does not ping connections before use. Call [`SqliteStore::migrate`] next.
    ///
    /// An in-memory database lives in one connection, so its pool holds exactly one.
    ///
    /// # Errors
    /// [`SetupError::Database`] when the URL is malformed or the file cannot be opened.
    pub async fn connect(url: &str) -> Result<Self, SetupError> {
        let memory = url.contains(":memory:") || url.contains("mode=memory");
        let mut options = SqliteConnectOptions::from_str(url)?
            .create_if_missing(true)
            .busy_timeout(DEFAULT_BUSY_TIMEOUT);
        if !memory {
            options = options.journal_mode(SqliteJournalMode::Wal);
        }
        let mut pool = SqlitePoolOptions::new().test_before_acquire(false);
        if memory {
            pool = pool
                .max_connections(1)
                .min_connections(1)
                .idle_timeout(None)
                .max_lifetime(None);
        }
        let pool = pool.connect_with(options).await?;
        Self::builder(pool).build()
    }

    /// A store on a pool you built. Set WAL mode and a busy timeout on its connect options
    /// (as [`SqliteStore::connect`] does), or concurrent writers fail with "database is locked".
    pub fn builder(pool: SqlitePool) -> SqliteStoreBuilder {
        SqliteStoreBuilder {
            pool,
            table: "idempotency_records".into(),
            clock: None,
            queue: None,
            max_transaction: DEFAULT_BUSY_TIMEOUT,
            change_poll: std::time::Duration::from_millis(250),
        }
    }

    /// Runs the store's migrations. Safe from several processes at once: a run that lost a
    /// race (another process applied the same migration first, and the versions table
    /// refused the second) runs again and finds it applied. A database already migrated is
    /// only read. Applied versions are tracked in `<table>_migrations`.
    ///
    /// # Errors
    /// [`SetupError::Migrate`].
    pub async fn migrate(&self) -> Result<(), SetupError> {
        let sql = include_str!("../../../migrations/sqlite/0001_create_records.sql")
            .replace("{table}", &self.sql.table);
        let mut migrator = Migrator::with_migrations(vec![Migration::new(
            1,
            "create records".into(),
            MigrationType::Simple,
            AssertSqlSafe(sql).into_sql_str(),
            false,
        )]);
        migrator.dangerous_set_table_name(format!("{}_migrations", self.sql.table));
        // sqlx's SQLite migrator takes no lock (its `lock` does nothing): two processes
        // migrating a new file at once can both find a migration missing and both apply it,
        // and the second fails on the versions table (each migration is one transaction, so
        // nothing is left half applied). Run again, the migrator finds what the other
        // applied. Each such failure means another process applied a migration, so a few
        // runs are enough; any other error is returned as it came.
        let mut lost = 0;
        loop {
            match migrator.run(&self.pool).await {
                Err(e) if lost < 4 && lost_migration_race(&e) => lost += 1,
                done => return Ok(done?),
            }
        }
    }

    /// [`Store::claim`](crate::Store::claim) on a connection or transaction you provide.
    ///
    /// # Errors
    /// As [`Store::claim`](crate::Store::claim).
    pub async fn claim_on(
        &self,
        conn: &mut SqliteConnection,
        req: ClaimRequest<'_>,
    ) -> Result<ClaimOutcome, StoreError> {
        self.claim_reported(conn, req)
            .await
            .map(|(outcome, _)| outcome)
    }

    /// [`SqliteStore::claim_on`], and how long a replayed record still lives
    /// ([`Store::claim_with_expiry`](crate::Store::claim_with_expiry)).
    pub(crate) async fn claim_reported(
        &self,
        conn: &mut SqliteConnection,
        req: ClaimRequest<'_>,
    ) -> Result<(ClaimOutcome, Option<std::time::Duration>), StoreError> {
        let (scope, key) = (req.key.scope.as_str(), req.key.key.as_str());
        for _ in 0..MAX_CLAIM_ATTEMPTS {
            self.sent.bump();
            let row = sqlx::query(q(&self.sql.read))
                .bind(scope)
                .bind(key)
                .fetch_optional(&mut *conn)
                .await
                .map_err(db_error)?;
            let token = LeaseToken::generate();
            let Some(row) = row else {
                let until = self
                    .claim_write(conn, &self.sql.insert, &req, token, None)
                    .await?;
                match until {
                    Some(until) => return Ok((claimed(token, until, false), None)),
                    None => continue, // a concurrent claimer inserted first: read its row
                }
            };
            match Self::decide_row(&row, &req)? {
                Decision::Report(outcome, lives) => return Ok((outcome, lives)),
                Decision::TakeOver(old) => {
                    let until = self
                        .claim_write(conn, &self.sql.take_over, &req, token, Some(old))
                        .await?;
                    if let Some(until) = until {
                        return Ok((claimed(token, until, true), None));
                    }
                }
            }
        }
        Err(StoreError::unavailable(Contention))
    }
}

sql_store_common!(SqliteStore, SqlitePool, sqlx::Sqlite, SqliteConnection);

/// Whether a migration run failed because another process applied the same migration
/// first: the versions table's key refused the second insert, or (WAL) this run's read
/// snapshot was overtaken by the other's commit (`SQLITE_BUSY_SNAPSHOT`).
fn lost_migration_race(e: &sqlx::migrate::MigrateError) -> bool {
    use sqlx::migrate::MigrateError;
    let (MigrateError::Execute(sqlx::Error::Database(d))
    | MigrateError::ExecuteMigration(sqlx::Error::Database(d), _)) = e
    else {
        return false;
    };
    d.kind() == sqlx::error::ErrorKind::UniqueViolation || d.code().as_deref() == Some("517")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The write queue is the caller's choice: a store has none unless built with one, and
    /// its clones share the one it has (the engine clones the store for each transaction).
    #[tokio::test]
    async fn the_write_queue_is_opt_in_and_shared_by_clones()
    -> Result<(), Box<dyn std::error::Error>> {
        let pool = SqliteStore::connect("sqlite::memory:")
            .await?
            .pool()
            .clone();
        let plain = SqliteStore::builder(pool.clone()).build()?;
        assert!(plain.writes.turn().await.is_none(), "no queue by default");
        let queued = SqliteStore::builder(pool)
            .queue_transactions(Duration::from_millis(50))
            .build()?;
        let turn = queued.writes.turn().await;
        assert!(turn.is_some());
        // A clone waits for that same turn, and goes on without one after its wait.
        assert!(queued.clone().writes.turn().await.is_none());
        drop(turn);
        assert!(queued.clone().writes.turn().await.is_some());
        Ok(())
    }
}
