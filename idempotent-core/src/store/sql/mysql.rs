//! The MySQL / MariaDB store.

use super::{
    Contention, Counter, Decision, MAX_CLAIM_ATTEMPTS, SetupError, build_record, claimed, db_error,
    from_millis, identifier, millis, outcome_columns, q, record_columns,
};
use crate::store::fence::LeaseToken;
use crate::store::record::{RecordKey, RecordState, StoredOutcome};
use crate::store::{ClaimOutcome, ClaimRequest, Deleted, StoreError};
use sqlx::migrate::{Migration, MigrationType, Migrator};
use sqlx::mysql::{MySqlConnection, MySqlPool};
use sqlx::{AssertSqlSafe, Row, SqlSafeStr};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// The database clock, in integer milliseconds since the Unix epoch: the start of the current
/// statement (MySQL and MariaDB evaluate `UTC_TIMESTAMP()` once per statement), in UTC, so
/// neither the session's time zone nor a daylight-saving change moves it (`UNIX_TIMESTAMP(NOW())`
/// would be ambiguous for an hour a year in a zone with DST).
const NOW: &str = "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)";

/// The longest lease, ttl or lease + ttl written, in milliseconds (about 3,170 years): keeps
/// `now + duration` inside a signed BIGINT, which MySQL refuses to overflow.
const MAX_MS: i64 = 100_000_000_000_000;

/// Milliseconds of `d`, rounded up and bounded by [`MAX_MS`].
pub(crate) fn bounded_millis(d: Duration) -> i64 {
    millis(d).min(MAX_MS)
}

/// A store in a MySQL or MariaDB (InnoDB) table, on a pool you already have.
///
/// All times (leases, expiry) come from the database's clock (`UTC_TIMESTAMP(6)`, evaluated
/// once per statement), so application servers with skewed clocks agree. A replay costs one
/// `SELECT` that takes no lock; a first execution costs three statements (that `SELECT`, the
/// `INSERT` that claims, the `UPDATE` that completes): MySQL has no `RETURNING` and no
/// data-modifying CTE, so the read and the insert cannot be one statement as on PostgreSQL.
/// The insert alone settles races: of concurrent claimers exactly one inserts, the others
/// get a duplicate-key error and read the winner's row. sqlx pools ping every connection they
/// hand out unless `test_before_acquire(false)` is set, which doubles the round trips of every
/// statement: turn it off for this pool where your network allows.
///
/// Tested on MariaDB 10.11. The statements are written for MySQL 8 as well (no `RETURNING`,
/// no `SET STATEMENT`, nothing else MariaDB alone has), but no MySQL server has run them
/// yet. Differences from [`PostgresStore`](crate::PostgresStore), all handled here:
/// - **Isolation.** InnoDB's default is REPEATABLE READ. The store's own statements outside
///   a transaction each run alone (autocommit), so they read what committed before them;
///   transactional mode pins READ COMMITTED for its transactions. If you call
///   [`MySqlStore::claim_on`] inside a transaction of yours, run that at READ COMMITTED
///   (under REPEATABLE READ a concurrent claimer's row stays invisible to your snapshot and
///   the claim gives up after a few attempts, `Unavailable`).
/// - **Clock precision.** Milliseconds, as on the other stores (`UTC_TIMESTAMP(6)` rounded
///   down to the millisecond; `NOW()` without a precision would be whole seconds).
/// - **Errors.** A duplicate key (1062) means a concurrent claimer inserted first (read
///   again); a deadlock (1213, SQLSTATE 40001) leaves nothing written and a fenced write runs
///   again (bounded), as after PostgreSQL's serialization failures; a lock wait timeout
///   (1205) is `Unavailable` (answered 503). Errors do not abort a MySQL transaction as they
///   do a PostgreSQL one: only the failing statement is undone, except a deadlock, whose
///   victim InnoDB rolls back whole. In transactional mode the session's autocommit is off
///   for the transaction, so a handler's statements after such a rollback open a new
///   transaction instead of each committing alone; in single commit the claim rolled back
///   too, so the fenced complete is refused and nothing commits. In two commits the claim
///   committed before, so a handler that answers a success after that error has its later
///   writes stored without its earlier ones: answer a database error with a 5xx (or `?`).
/// - **Values.** Scope and key are `VARBINARY` (byte comparison: no case folding, no pad
///   space); a response is one `LONGBLOB` row value, so keep the route's response limit below
///   the server's `max_allowed_packet` (16 MiB by default on MariaDB, 64 MiB on MySQL 8): a
///   larger one fails to complete and is retried, then released with its lease.
/// - **Versions.** `FOR UPDATE NOWAIT` (take-overs, heartbeats) and `SKIP LOCKED` (the
///   sweeper) need MySQL 8.0.1+ or MariaDB 10.6+. The pool's sessions must autocommit
///   (MySQL's default): [`MySqlStore::migrate`] refuses a pool whose sessions do not, and so
///   does the first claim outside a transaction (503); the check runs once per store, so code
///   that turns autocommit off on a session and gives it back to the pool defeats it (give
///   the store a pool of its own, or never leave a session so). Two commits (and unprotected
///   transactional requests) need the `CREATE TEMPORARY TABLES` privilege: their
///   transaction carries a marker row in a temporary table, which tells a rollback by the
///   server (a deadlock) from a commit, before the record completes.
/// - **Lease ends.** The claim, the take-over and the heartbeat return the new lease end
///   through `LAST_INSERT_ID(expr)` (the server reports it with the statement's row count),
///   which stands in for `RETURNING`: in a transactional handler, `LAST_INSERT_ID()` read
///   before the handler's own first insert returns that value, not one of yours.
///
/// ```no_run
/// use idempotent_core::MySqlStore;
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = sqlx::mysql::MySqlPoolOptions::new()
///     .test_before_acquire(false)
///     .connect("mysql://root@127.0.0.1:3306/app")
///     .await?;
/// let store = MySqlStore::builder(pool).table("idempotency_records").build()?;
/// store.migrate().await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct MySqlStore {
    pub(crate) pool: MySqlPool,
    pub(crate) sql: Arc<Statements>,
    pub(crate) sent: Arc<Counter>,
    /// Set once a session of the pool was found to autocommit (see `check_autocommit`).
    autocommit_checked: Arc<std::sync::atomic::AtomicBool>,
    /// The connections fenced writes (renewals, completes, releases) run on.
    pub(crate) fenced: Arc<super::FencedConns>,
    /// Wakes requests waiting on a record: in process (the engines over this store), and
    /// every 250 ms at most for answers from other instances. MySQL has no notifications, and
    /// waiting on the record's named lock would hold a pooled connection per waiter.
    pub(crate) changes: crate::store::Changes,
}

/// Builds a [`MySqlStore`].
#[derive(Debug)]
pub struct MySqlStoreBuilder {
    pool: MySqlPool,
    table: String,
    change_poll: std::time::Duration,
}

impl MySqlStoreBuilder {
    /// The longest a request waiting for a running duplicate's answer (a route's `wait`) goes
    /// without looking at the store again, when no notification woke it (default 250 ms;
    /// MySQL has no notifications: a waiter on another instance finds the answer by looking again, first after 20 ms, then at doubling pauses up to this). At least 10 ms.
    #[must_use]
    pub fn change_poll(mut self, every: std::time::Duration) -> Self {
        self.change_poll = every.max(std::time::Duration::from_millis(10));
        self
    }

    /// The table's name (default `idempotency_records`), in the pool's database.
    #[must_use]
    pub fn table(mut self, table: &str) -> Self {
        table.clone_into(&mut self.table);
        self
    }

    /// Checks the name and prepares the statements.
    ///
    /// # Errors
    /// [`SetupError::InvalidIdentifier`] for a table name that is not `[a-z_][a-z0-9_]*`.
    pub fn build(self) -> Result<MySqlStore, SetupError> {
        let table = identifier(&self.table)?;
        Ok(MySqlStore {
            pool: self.pool,
            sql: Arc::new(Statements::new(&table)),
            sent: Arc::default(),
            autocommit_checked: Arc::default(),
            fenced: Arc::new(super::FencedConns::new(true)),
            changes: crate::store::Changes::in_process(self.change_poll),
        })
    }
}

#[derive(Debug)]
pub(crate) struct Statements {
    pub(crate) table: String,
    pub(crate) read: Arc<str>,
    pub(crate) insert: Arc<str>,
    pub(crate) tx_insert: Arc<str>,
    lock_row: Arc<str>,
    pub(crate) get_lock: Arc<str>,
    take_over: Arc<str>,
    pub(crate) complete: Arc<str>,
    release: Arc<str>,
    extend: Arc<str>,
    purge_pick: Arc<str>,
    purge_delete: Arc<str>,
    get: Arc<str>,
    read_any: Arc<str>,
    delete: Arc<str>,
}

/// The columns `Store::get` and the delete read, times as epoch milliseconds.
const RECORD_COLUMNS: &str = "fingerprint, done, token, locked_until, status, headers, body, \
    oversized, created_at, completed_at, expires_at";

impl Statements {
    fn new(table: &str) -> Self {
        // Quoted: a name reserved on MySQL 8 but not on MariaDB (`groups`, `rank`) passes
        // `identifier` and must still work.
        let quoted = format!("`{table}`");
        let s = |sql: &str| -> Arc<str> {
            sql.replace("{t}", &quoted)
                .replace("{now}", NOW)
                .replace("{record}", RECORD_COLUMNS)
                .into()
        };
        Statements {
            table: table.to_owned(),
            // Read-only (a consistent read: no lock): settles replays, in-progress and
            // mismatch. It never decides to insert; a miss goes to `insert`.
            read: s("SELECT fingerprint, done, token,
                    expires_at <= {now} AS expired,
                    COALESCE(NOT done AND locked_until <= {now}, FALSE) AS lease_over,
                    GREATEST(0, COALESCE(COALESCE(locked_until, expires_at) - {now}, 0)) AS retry_ms,
                    status, headers, body, oversized
                FROM {t} WHERE scope = ? AND `key` = ?"),
            // The claim itself: one atomic statement on the primary key, so of N concurrent
            // claimers exactly one inserts; the others get a duplicate-key error and read the
            // winner's row. `LAST_INSERT_ID(expr)` hands the lease end back with the row count.
            insert: s("INSERT INTO {t} (scope, `key`, fingerprint, done, token, locked_until, created_at, expires_at)
                VALUES (?, ?, ?, FALSE, ?, LAST_INSERT_ID({now} + ?), {now}, {now} + ?)"),
            // The claim inside a single-commit transaction: only the holder of the key's named
            // lock inserts (see `tx/mysql.rs`). `GET_LOCK(…, 0)` never waits; no row inserted
            // and no error means another session holds the key.
            tx_insert: s("INSERT INTO {t} (scope, `key`, fingerprint, done, token, locked_until, created_at, expires_at)
                SELECT ?, ?, ?, FALSE, ?, LAST_INSERT_ID({now} + ?), {now}, {now} + ?
                FROM DUAL WHERE GET_LOCK(?, 0) = 1"),
            // Locks the row a take-over is about to write, without waiting: an error at once
            // (1205 on MariaDB, 3572 on MySQL) when another transaction holds it.
            lock_row: s("SELECT 1 FROM {t} WHERE scope = ? AND `key` = ? AND token = ?
                FOR UPDATE NOWAIT"),
            // The key's named lock, without waiting (1: taken; 0: another session holds it).
            get_lock: s("SELECT GET_LOCK(?, 0)"),
            // The rare path: take over an expired record, or a lease that ran out (the caller
            // checked the fingerprint on the row it read). Compare-and-swap on the old token: of
            // two racing retries only one matches it, and an unchanged token means an unchanged
            // fingerprint (every claim or take-over writes a new token). MySQL evaluates the
            // WHERE before the assignments.
            take_over: s("UPDATE {t} SET fingerprint = ?, done = FALSE, token = ?,
                    locked_until = LAST_INSERT_ID({now} + ?), created_at = {now}, completed_at = NULL,
                    status = NULL, headers = NULL, body = NULL, oversized = NULL,
                    expires_at = {now} + ?
                WHERE scope = ? AND `key` = ? AND token = ?
                  AND (expires_at <= {now} OR (NOT done AND locked_until <= {now}))"),
            // Fenced: a stale owner (its lease taken over) matches no row and cannot overwrite.
            // (`done` is assigned before `expires_at`, which does not read it.)
            complete: s("UPDATE {t} SET done = TRUE, status = ?, headers = ?, body = ?, oversized = ?,
                    completed_at = {now}, locked_until = NULL,
                    expires_at = GREATEST(expires_at, {now} + ?)
                WHERE scope = ? AND `key` = ? AND token = ? AND NOT done AND expires_at > {now}"),
            // Fenced like complete: a stale owner cannot delete the new owner's record.
            release: s("DELETE FROM {t}
                WHERE scope = ? AND `key` = ? AND token = ? AND NOT done AND expires_at > {now}"),
            // Fenced heartbeat; keeps the record alive at least as long as its lease. Both
            // assignments spell the new lease end out: MySQL assigns left to right, each
            // seeing the ones before it, and this does not depend on that.
            extend: s("UPDATE {t} SET locked_until = LAST_INSERT_ID({now} + ?),
                    expires_at = GREATEST(expires_at, {now} + ?)
                WHERE scope = ? AND `key` = ? AND token = ? AND NOT done AND expires_at > {now}"),
            // The sweeper's batch, in a short READ COMMITTED transaction: the expired rows no
            // other transaction holds (`SKIP LOCKED`: MySQL 8.0.1+, MariaDB 10.6+), in expiry
            // order through the expiry index, locked; then each deleted by its primary key
            // (`purge_batch`), a lookup that touches no other row. A plain `DELETE … LIMIT`
            // (or one `DELETE` of the picked rows, which the optimizer may run as a scan)
            // waits on a row another transaction holds (a single-commit take-over of an
            // expired record), keeping the locks of the rows it already deleted, whose keys
            // then answer 409 though they expired.
            purge_pick: s("SELECT scope, `key`, token FROM {t} WHERE expires_at <= {now}
                ORDER BY expires_at LIMIT ? FOR UPDATE SKIP LOCKED"),
            purge_delete: s("DELETE FROM {t} WHERE scope = "),
            get: s("SELECT {record} FROM {t} WHERE scope = ? AND `key` = ? AND expires_at > {now}"),
            // The delete's read: the row whatever its expiry, and whether it expired.
            read_any: s("SELECT {record}, expires_at <= {now} AS expired
                FROM {t} WHERE scope = ? AND `key` = ?"),
            // Compare-and-delete on what the read saw: the same token and state (a completed
            // record's content never changes under one token; a take-over writes a new one).
            delete: s("DELETE FROM {t} WHERE scope = ? AND `key` = ? AND token = ? AND done = ?"),
        }
    }
}

impl MySqlStore {
    /// The complete statement (the same every time here; PostgreSQL's depends on its table).
    async fn complete_sql(&self) -> Arc<str> {
        Arc::clone(&self.sql.complete)
    }

    /// The release statement (see [`Self::complete_sql`]).
    async fn release_sql(&self) -> Arc<str> {
        Arc::clone(&self.sql.release)
    }

    /// A store on `pool` with the default table (`idempotency_records`).
    ///
    /// # Errors
    /// Never for the default; see [`MySqlStoreBuilder::build`].
    pub fn new(pool: MySqlPool) -> Result<Self, SetupError> {
        Self::builder(pool).build()
    }

    /// Starts a builder to choose the table.
    pub fn builder(pool: MySqlPool) -> MySqlStoreBuilder {
        MySqlStoreBuilder {
            pool,
            table: "idempotency_records".into(),
            change_poll: std::time::Duration::from_millis(250),
        }
    }

    /// Runs the store's migrations: the table and its expiry index. Safe to call from every
    /// instance at start-up: concurrent runs on one table are serialised by a named lock the
    /// store takes, waiting up to 300 s for another instance's run (not by sqlx's own, which MariaDB does not
    /// wait for: it answers `GET_LOCK(name, -1)` at once). Applied versions are tracked in
    /// `<table>_migrations`, apart from your own migrations.
    ///
    /// # Errors
    /// [`SetupError::Database`] or [`SetupError::Migrate`]; [`SetupError::Database`] with a
    /// configuration error when the pool's sessions do not autocommit (the store's writes
    /// outside transactions rely on it).
    pub async fn migrate(&self) -> Result<(), SetupError> {
        let mut conn = self.pool.acquire().await?;
        let on: i64 = sqlx::query_scalar("SELECT @@SESSION.autocommit")
            .fetch_one(&mut *conn)
            .await?;
        if on != 1 {
            return Err(SetupError::Database(sqlx::Error::Configuration(Box::new(
                AutocommitOff,
            ))));
        }
        // The lock is the session's: the migrations run on this connection, which is closed,
        // never pooled, when it is dropped. A caller that gives up while GET_LOCK waits (a
        // start-up timeout), a failed migration (sqlx leaves its own lock held then) or a failed
        // release would otherwise put a session holding a lock back in the pool, and every
        // other instance's migration would wait for it.
        conn.close_on_drop();
        let name = format!("{}.{}", "idempotent-migrate", self.sql.table);
        let got: Option<i64> =
            sqlx::query_scalar("SELECT GET_LOCK(SHA1(CONCAT(IFNULL(DATABASE(), ''), '.', ?)), ?)")
                .bind(&name)
                .bind(MIGRATION_LOCK_WAIT.as_secs())
                .fetch_one(&mut *conn)
                .await?;
        if got != Some(1) {
            return Err(SetupError::Database(sqlx::Error::Configuration(Box::new(
                MigrationLockBusy,
            ))));
        }
        let migrated = self.run_migrations(&mut conn).await;
        let released =
            sqlx::query("SELECT RELEASE_LOCK(SHA1(CONCAT(IFNULL(DATABASE(), ''), '.', ?)))")
                .bind(&name)
                .execute(&mut *conn)
                .await;
        drop(conn);
        migrated?;
        released?;
        Ok(())
    }

    /// The migrations themselves, on `conn` (which holds the migration lock).
    async fn run_migrations(
        &self,
        conn: &mut sqlx::pool::PoolConnection<sqlx::MySql>,
    ) -> Result<(), SetupError> {
        let sql = include_str!("../../../migrations/mysql/0001_create_records.sql")
            .replace("{table}", &format!("`{}`", self.sql.table))
            .replace("{name}", &self.sql.table);
        let mut migrator = Migrator::with_migrations(vec![Migration::new(
            1,
            "create records".into(),
            MigrationType::Simple,
            AssertSqlSafe(sql).into_sql_str(),
            // MySQL commits DDL implicitly: a transaction around it would hold nothing.
            true,
        )]);
        migrator.dangerous_set_table_name(format!("{}_migrations", self.sql.table));
        // `run` takes an `Acquire`, whose future over a borrowed connection is not `Send`
        // (sqlx's "implementation of `Acquire` is not general enough"); `run_direct` is what
        // `run` calls, the way sqlx's own `migrate!` callers get around it.
        migrator.run_direct(None, &mut **conn, false).await?;
        Ok(())
    }

    /// [`Store::claim`](crate::Store::claim) on a connection or transaction you provide
    /// (inside a transaction, at READ COMMITTED: see the [type's docs](MySqlStore)).
    ///
    /// # Errors
    /// As [`Store::claim`](crate::Store::claim).
    pub async fn claim_on(
        &self,
        conn: &mut MySqlConnection,
        req: ClaimRequest<'_>,
    ) -> Result<ClaimOutcome, StoreError> {
        self.claim_reported(conn, req)
            .await
            .map(|(outcome, _)| outcome)
    }

    /// [`MySqlStore::claim_on`], and how long a replayed record still lives
    /// ([`Store::claim_with_expiry`](crate::Store::claim_with_expiry)).
    pub(crate) async fn claim_reported(
        &self,
        conn: &mut MySqlConnection,
        req: ClaimRequest<'_>,
    ) -> Result<(ClaimOutcome, Option<std::time::Duration>), StoreError> {
        if !sqlx::Connection::is_in_transaction(&*conn) {
            self.check_autocommit(conn).await?;
        }
        for _ in 0..MAX_CLAIM_ATTEMPTS {
            let row = self.read_row(conn, &req).await?;
            let token = LeaseToken::generate();
            let Some(row) = row else {
                match self
                    .insert(conn, &self.sql.insert, &req, token, None)
                    .await?
                {
                    Inserted::Claimed(until) => return Ok((claimed(token, until, false), None)),
                    // A concurrent claimer inserted first: read its row.
                    Inserted::Duplicate | Inserted::NotLocked => continue,
                }
            };
            match Self::decide_row(&row, &req)? {
                Decision::Report(outcome, lives) => return Ok((outcome, lives)),
                Decision::TakeOver(old) => {
                    if let Some(outcome) = self.take_over(conn, &req, token, old).await? {
                        return Ok((outcome, None));
                    }
                }
            }
        }
        Err(StoreError::unavailable(Contention))
    }

    /// The claim's read (`read`): the row as the claim decides on it, or none.
    pub(crate) async fn read_row(
        &self,
        conn: &mut MySqlConnection,
        req: &ClaimRequest<'_>,
    ) -> Result<Option<sqlx::mysql::MySqlRow>, StoreError> {
        self.sent.bump();
        sqlx::query(q(&self.sql.read))
            .bind(req.key.scope.as_str())
            .bind(req.key.key.as_str())
            .fetch_optional(&mut *conn)
            .await
            .map_err(db_error)
    }

    /// Runs an insert-shaped claim (`insert`, or `tx_insert` with the named lock `lock`).
    pub(crate) async fn insert(
        &self,
        conn: &mut MySqlConnection,
        sql: &Arc<str>,
        req: &ClaimRequest<'_>,
        token: LeaseToken,
        lock: Option<&str>,
    ) -> Result<Inserted, StoreError> {
        self.sent.bump();
        let fingerprint = req.fingerprint.to_stored();
        let mut query = sqlx::query(q(sql))
            .bind(req.key.scope.as_str())
            .bind(req.key.key.as_str())
            .bind(&fingerprint[..])
            .bind(token.as_uuid())
            .bind(bounded_millis(req.lease))
            .bind(bounded_millis(req.lease.saturating_add(req.ttl)));
        if let Some(lock) = lock {
            query = query.bind(lock);
        }
        match query.execute(&mut *conn).await {
            Ok(done) if done.rows_affected() == 1 => Ok(Inserted::Claimed(lease_end(&done)?)),
            Ok(_) => Ok(Inserted::NotLocked),
            Err(e) if is_duplicate(&e) => Ok(Inserted::Duplicate),
            Err(e) => Err(db_error(e)),
        }
    }

    /// Takes over a record whose lease or ttl ran out: the new claim; in progress when another
    /// transaction holds the row's lock (an owner between its complete and its COMMIT: the
    /// take-over never waits for it); `None` when another claimer took it over first (read it
    /// again). Outside a transaction, in a short one of its own (READ COMMITTED): the row is
    /// locked with `FOR UPDATE NOWAIT` (MySQL 8 and MariaDB 10.3+), which fails at once where
    /// an `UPDATE` would wait up to `innodb_lock_wait_timeout` (50 s by default) holding a
    /// pooled connection. The rare path: BEGIN, the lock, the `UPDATE`, COMMIT.
    pub(crate) async fn take_over(
        &self,
        conn: &mut MySqlConnection,
        req: &ClaimRequest<'_>,
        token: LeaseToken,
        old: LeaseToken,
    ) -> Result<Option<ClaimOutcome>, StoreError> {
        if sqlx::Connection::is_in_transaction(&*conn) {
            return self.take_over_in(conn, req, token, old).await;
        }
        self.short_tx(
            conn,
            async |tx| self.take_over_in(tx, req, token, old).await,
            |outcome| matches!(outcome, Ok(Some(ClaimOutcome::Claimed(_)))),
        )
        .await
    }

    /// Runs `work` in a short transaction of the store's own on `conn` (not in one already):
    /// READ COMMITTED, with the session's `wait_timeout` lowered to 10 s until it ends, so a
    /// session that stops between its statements while it holds a row lock (a frozen process,
    /// a lost network) is ended by the server within seconds, not hours, and the lock goes
    /// with it. Commits when `commit` says so, else rolls back; the end and the idle limit put
    /// back go in one round trip.
    async fn short_tx<T>(
        &self,
        conn: &mut MySqlConnection,
        work: impl AsyncFnOnce(&mut MySqlConnection) -> Result<T, StoreError>,
        commit: impl FnOnce(&Result<T, StoreError>) -> bool,
    ) -> Result<T, StoreError> {
        self.sent.bump();
        let mut tx = sqlx::Connection::begin_with(&mut *conn, BEGIN_SHORT)
            .await
            .map_err(db_error)?;
        let outcome = work(&mut tx).await;
        let end = if commit(&outcome) {
            END_SHORT_COMMIT
        } else {
            END_SHORT_ROLLBACK
        };
        self.sent.bump();
        // sqlx still counts the transaction: dropped, `tx` queues a ROLLBACK that does
        // nothing now (it goes out with the connection's next statement).
        sqlx::raw_sql(end)
            .execute(&mut *tx)
            .await
            .map_err(db_error)?;
        outcome
    }

    /// [`MySqlStore::take_over`] inside a transaction: the row locked without waiting, then the
    /// `take_over` statement.
    async fn take_over_in(
        &self,
        conn: &mut MySqlConnection,
        req: &ClaimRequest<'_>,
        token: LeaseToken,
        old: LeaseToken,
    ) -> Result<Option<ClaimOutcome>, StoreError> {
        match self.lock_row(conn, req.key, old).await {
            Ok(Some(_)) => {}
            // Changed since the read (taken over, completed, released): read it again.
            Ok(None) => return Ok(None),
            Err(e) if is_lock_wait_timeout(&e) => {
                return Ok(Some(ClaimOutcome::InProgress {
                    retry_after: ROW_LOCKED_RETRY_AFTER,
                }));
            }
            Err(e) => return Err(db_error(e)),
        }
        self.sent.bump();
        let fingerprint = req.fingerprint.to_stored();
        let done = sqlx::query(q(&self.sql.take_over))
            .bind(&fingerprint[..])
            .bind(token.as_uuid())
            .bind(bounded_millis(req.lease))
            .bind(bounded_millis(req.lease.saturating_add(req.ttl)))
            .bind(req.key.scope.as_str())
            .bind(req.key.key.as_str())
            .bind(old.as_uuid())
            .execute(&mut *conn)
            .await
            .map_err(db_error)?;
        if done.rows_affected() == 1 {
            Ok(Some(claimed(token, lease_end(&done)?, true)))
        } else {
            Ok(None)
        }
    }

    /// The complete statement with its parameters bound: the outcome's columns and the ttl,
    /// then scope, key and token (MySQL's parameters are positional, in the text's order).
    pub(crate) fn complete_query<'q>(
        &self,
        sql: &Arc<str>,
        key: &'q RecordKey,
        token: LeaseToken,
        outcome: &StoredOutcome,
        ttl: Duration,
    ) -> sqlx::query::Query<'q, sqlx::MySql, sqlx::mysql::MySqlArguments> {
        let c = outcome_columns(outcome);
        self.sent.bump();
        sqlx::query(q(sql))
            .bind(c.status)
            .bind(c.headers)
            .bind(c.body)
            .bind(c.oversized)
            .bind(bounded_millis(ttl))
            .bind(key.scope.as_str())
            .bind(key.key.as_str())
            .bind(token.as_uuid())
    }

    /// The fenced heartbeat: the new lease end, or `StaleLease`. Like a take-over, it never
    /// waits on the row's lock: the lock's holder is almost always this execution's own
    /// complete on the two-commit path, its COMMIT on its way (or stalled), and an `UPDATE`
    /// queued behind it would hold a pooled connection up to `innodb_lock_wait_timeout`
    /// (50 s by default), then extend a lease its owner may have given up. So: BEGIN, the row
    /// locked with `FOR UPDATE NOWAIT` (a lock not granted is unavailable, and the heartbeat
    /// tries again), the `UPDATE`, COMMIT.
    async fn extend_once(
        &self,
        key: &RecordKey,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<SystemTime, StoreError> {
        let mut conflicts = 0;
        loop {
            // On a pooled connection, or a fresh one after a write was abandoned
            // (`FencedConns`).
            let extended = self
                .fenced
                .run(&self.pool, async |conn| {
                    self.short_tx(
                        conn,
                        async |tx| self.extend_in(tx, key, token, lease).await,
                        Result::is_ok,
                    )
                    .await
                })
                .await;
            match extended {
                Err(e) if super::again_after_conflict(&e, &mut conflicts).await => {}
                extended => return extended,
            }
        }
    }

    /// Locks the row of `key` while `token` holds it, without waiting (`FOR UPDATE NOWAIT`; a
    /// lock not granted is an error, see [`is_lock_wait_timeout`]); `None`: the token does
    /// not hold it.
    async fn lock_row(
        &self,
        conn: &mut MySqlConnection,
        key: &RecordKey,
        token: LeaseToken,
    ) -> Result<Option<sqlx::mysql::MySqlRow>, sqlx::Error> {
        self.sent.bump();
        sqlx::query(q(&self.sql.lock_row))
            .bind(key.scope.as_str())
            .bind(key.key.as_str())
            .bind(token.as_uuid())
            .fetch_optional(&mut *conn)
            .await
    }

    /// [`MySqlStore::extend_once`] inside its transaction: the row locked without waiting,
    /// then the `extend` statement.
    async fn extend_in(
        &self,
        conn: &mut MySqlConnection,
        key: &RecordKey,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<SystemTime, StoreError> {
        if self
            .lock_row(conn, key, token)
            .await
            .map_err(db_error)?
            .is_none()
        {
            return Err(StoreError::StaleLease);
        }
        self.sent.bump();
        let lease = bounded_millis(lease);
        let done = sqlx::query(q(&self.sql.extend))
            .bind(lease)
            .bind(lease)
            .bind(key.scope.as_str())
            .bind(key.key.as_str())
            .bind(token.as_uuid())
            .execute(&mut *conn)
            .await
            .map_err(db_error)?;
        // The connections report rows matched (sqlx asks for FOUND_ROWS), so a heartbeat
        // within the same millisecond as the last still counts.
        if done.rows_affected() == 1 {
            Ok(from_millis(lease_end(&done)?))
        } else {
            Err(StoreError::StaleLease)
        }
    }

    /// One bounded batch of the sweeper (`purge_pick`, then `purge_delete`): never waits on a
    /// row another transaction holds.
    async fn purge_batch(&self, batch: usize) -> Result<u64, StoreError> {
        let mut conn = self.conn().await?;
        self.short_tx(
            &mut conn,
            async |tx| self.purge_in(tx, batch).await,
            Result::is_ok,
        )
        .await
    }

    /// [`MySqlStore::purge_batch`] inside its transaction.
    async fn purge_in(&self, tx: &mut MySqlConnection, batch: usize) -> Result<u64, StoreError> {
        self.sent.bump();
        let rows: Vec<(Vec<u8>, Vec<u8>, uuid::Uuid)> = sqlx::query_as(q(&self.sql.purge_pick))
            .bind(i64::try_from(batch).unwrap_or(i64::MAX))
            .fetch_all(&mut *tx)
            .await
            .map_err(db_error)?;
        // One statement per row (the values written as hex literals: nothing but hex
        // digits stand for them), as few queries as keep each under 1 MiB, well below the
        // smallest default `max_allowed_packet` (4 MiB on MySQL 5.7, 16 MiB on MariaDB).
        let mut deleted = 0;
        let mut sql = String::new();
        for (i, (scope, key, token)) in rows.iter().enumerate() {
            sql.push_str(&self.sql.purge_delete);
            push_hex(&mut sql, scope);
            sql.push_str(" AND `key` = ");
            push_hex(&mut sql, key);
            sql.push_str(" AND token = ");
            push_hex(&mut sql, token.as_bytes());
            sql.push_str(";\n");
            if sql.len() >= PURGE_QUERY_BYTES || i + 1 == rows.len() {
                self.sent.bump();
                deleted += sqlx::raw_sql(AssertSqlSafe(std::mem::take(&mut sql)))
                    .execute(&mut *tx)
                    .await
                    .map_err(db_error)?
                    .rows_affected();
            }
        }
        Ok(deleted)
    }

    /// The first time a claim runs outside a transaction: whether the session commits each
    /// statement on its own (autocommit, MySQL's default), which the store's plain-mode
    /// statements rely on. With autocommit off (`init_connect`, a server default, a pool's
    /// `after_connect`) a claim and its complete would stay uncommitted, unseen by other
    /// instances and lost with the connection: every claim is refused instead (503, and an
    /// error in the log) until the store is on a pool whose sessions autocommit.
    async fn check_autocommit(&self, conn: &mut MySqlConnection) -> Result<(), StoreError> {
        use std::sync::atomic::Ordering;
        if self.autocommit_checked.load(Ordering::Relaxed) {
            return Ok(());
        }
        self.sent.bump();
        let on: i64 = sqlx::query_scalar("SELECT @@SESSION.autocommit")
            .fetch_one(&mut *conn)
            .await
            .map_err(db_error)?;
        if on == 1 {
            self.autocommit_checked.store(true, Ordering::Relaxed);
            Ok(())
        } else {
            tracing::error!(
                "idempotency: the MySQL store's sessions run with autocommit off; its claims and completes would never commit: every claim is refused until its pool's sessions autocommit"
            );
            Err(StoreError::unavailable(AutocommitOff))
        }
    }

    /// [`Store::delete`](crate::Store::delete): a read, then a compare-and-delete on what it
    /// read (MySQL's `DELETE` returns no rows).
    async fn delete_record(&self, key: &RecordKey, force: bool) -> Result<Deleted, StoreError> {
        for _ in 0..3 {
            self.sent.bump();
            let row = sqlx::query(q(&self.sql.read_any))
                .bind(key.scope.as_str())
                .bind(key.key.as_str())
                .fetch_optional(&self.pool)
                .await
                .map_err(db_error)?;
            let Some(row) = row else {
                return Ok(Deleted::Absent);
            };
            let expired: bool = row.try_get("expired").map_err(db_error)?;
            let columns = record_columns(&row).map_err(db_error)?;
            let (token, done) = (columns.token, columns.done);
            let record = build_record(key, columns)?;
            if !force && !expired && matches!(record.state, RecordState::InProgress { .. }) {
                return Ok(Deleted::InProgress(record));
            }
            self.sent.bump();
            let deleted = sqlx::query(q(&self.sql.delete))
                .bind(key.scope.as_str())
                .bind(key.key.as_str())
                .bind(token)
                .bind(done)
                .execute(&self.pool)
                .await
                .map_err(db_error)?;
            if deleted.rows_affected() == 1 {
                return Ok(Deleted::Deleted(record));
            }
            // Changed between the read and the delete (completed, taken over, released):
            // read it again.
        }
        Err(StoreError::Unavailable(
            "the record kept changing while it was being deleted; try again".into(),
        ))
    }
}

/// How long one query of the sweeper's deletes may grow before it is sent.
const PURGE_QUERY_BYTES: usize = 1 << 20;

/// Appends `bytes` as a hex literal (`X'…'`; `X''` for none).
fn push_hex(sql: &mut String, bytes: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    sql.reserve(bytes.len() * 2 + 3);
    sql.push_str("X'");
    for b in bytes {
        sql.push(char::from(HEX[usize::from(b >> 4)]));
        sql.push(char::from(HEX[usize::from(b & 15)]));
    }
    sql.push('\'');
}

/// The pool's sessions do not autocommit.
#[derive(Debug, thiserror::Error)]
#[error(
    "the MySQL store's sessions run with autocommit off, so its writes would never commit; give it a pool whose sessions autocommit (MySQL's default)"
)]
struct AutocommitOff;

/// How long [`MySqlStore::migrate`] waits for another instance's migrations of the same table
/// (the named lock that serialises them): 300 s.
const MIGRATION_LOCK_WAIT: Duration = Duration::from_secs(300);

#[derive(Debug, thiserror::Error)]
#[error(
    "another session held the MySQL store's migration lock for over 300 s; is a migration of this table stuck?"
)]
struct MigrationLockBusy;

/// What an insert-shaped claim did.
pub(crate) enum Inserted {
    /// Inserted; the lease ends at these epoch milliseconds.
    Claimed(i64),
    /// A row with this key exists (committed, or this session's own).
    Duplicate,
    /// Nothing inserted and no error: `tx_insert` did not get the key's named lock.
    NotLocked,
}

/// What a request whose record's row is locked by an open transaction is told to wait.
const ROW_LOCKED_RETRY_AFTER: Duration = Duration::from_secs(1);

/// The value a statement passed to `LAST_INSERT_ID(expr)`, as the server reported it.
fn lease_end(done: &sqlx::mysql::MySqlQueryResult) -> Result<i64, StoreError> {
    i64::try_from(done.last_insert_id())
        .ok()
        .filter(|ms| *ms > 0)
        .ok_or_else(|| StoreError::Corrupt("the server reported no lease end".into()))
}

/// MySQL's error number of a database error.
pub(crate) fn error_number(e: &sqlx::Error) -> Option<u16> {
    e.as_database_error()
        .and_then(|d| d.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>())
        .map(sqlx::mysql::MySqlDatabaseError::number)
}

/// `ER_DUP_ENTRY` (1062): a row with this primary key exists.
fn is_duplicate(e: &sqlx::Error) -> bool {
    error_number(e) == Some(1062)
}

/// A lock not granted: `ER_LOCK_WAIT_TIMEOUT` (1205; MariaDB's answer to `NOWAIT` too) or
/// MySQL's `ER_LOCK_NOWAIT` (3572).
fn is_lock_wait_timeout(e: &sqlx::Error) -> bool {
    matches!(error_number(e), Some(1205 | 3572))
}

/// The BEGIN of the store's own short transactions ([`MySqlStore::short_tx`]: a take-over, a
/// heartbeat, a sweep): the session's idle limit kept and lowered to 10 s, then READ
/// COMMITTED for this transaction only (transactional mode's BEGIN is in `tx/mysql.rs`).
const BEGIN_SHORT: &str = "SET @idempotent_wait_timeout = @@SESSION.wait_timeout, \
    SESSION wait_timeout = 10; SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION";

/// The ends of [`MySqlStore::short_tx`], with the session's idle limit put back.
const END_SHORT_COMMIT: &str = "COMMIT; SET SESSION wait_timeout = @idempotent_wait_timeout";
const END_SHORT_ROLLBACK: &str = "ROLLBACK; SET SESSION wait_timeout = @idempotent_wait_timeout";

sql_store_common!(@common MySqlStore, MySqlPool, sqlx::MySql, MySqlConnection);
