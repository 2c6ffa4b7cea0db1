//! The PostgreSQL store.

use super::{
    Contention, Counter, Decision, MAX_CLAIM_ATTEMPTS, SetupError, claimed, db_error, has_sqlstate,
    identifier, millis, q,
};
use crate::store::fence::LeaseToken;
use crate::store::{ClaimOutcome, ClaimRequest, StoreError};
use sqlx::migrate::{Migration, MigrationType, Migrator};
use sqlx::postgres::{PgConnection, PgPool};
use sqlx::{AssertSqlSafe, Row, SqlSafeStr};
use std::sync::Arc;

/// The database clock: the start of the current statement. Not `now()`, which inside a
/// transaction is the transaction's start (the statements also run in callers' transactions,
/// see [`PostgresStore::claim_on`]); and stable within one statement, unlike
/// `clock_timestamp()`.
const NOW: &str = "statement_timestamp()";

/// A store in a PostgreSQL table, on a pool you already have.
///
/// All times (leases, expiry) come from the database's clock (`statement_timestamp()`), so
/// application servers with skewed clocks agree. A replay costs one statement that writes nothing; a first execution
/// costs two (claim, complete). sqlx pools ping every connection they hand out unless
/// `test_before_acquire(false)` is set, which doubles the round trips of every statement:
/// turn it off for this pool where your network allows.
///
/// ```no_run
/// use idempotent_core::PostgresStore;
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = sqlx::postgres::PgPoolOptions::new()
///     .test_before_acquire(false)
///     .connect("postgres://postgres@127.0.0.1/app")
///     .await?;
/// let store = PostgresStore::builder(pool).schema("public").table("idempotency_records").build()?;
/// store.migrate().await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct PostgresStore {
    pub(crate) pool: PgPool,
    pub(crate) sql: Arc<Statements>,
    pub(crate) sent: Arc<Counter>,
    /// Set once a claim met a serialization failure: the server's default isolation is
    /// stricter than READ COMMITTED, so claims pin it (see [`PostgresStore::claim_on`]).
    pin_isolation: Arc<std::sync::atomic::AtomicBool>,
    /// Set once the functions transactional mode calls were found (`TxDatabase::ready`).
    pub(crate) functions_ready: Arc<std::sync::atomic::AtomicBool>,
    /// Whether the server's encoding is UTF8, learnt with `functions_ready`.
    pub(crate) server_utf8: Arc<std::sync::atomic::AtomicBool>,
    /// The connections fenced writes (renewals, completes, releases) run on.
    pub(crate) fenced: Arc<super::FencedConns>,
    /// Wakes requests waiting on a record: fed by a `LISTEN` connection (`pg_listen`).
    pub(crate) changes: crate::store::Changes,
    /// Whether completes and releases notify (the `waited` column is there).
    pub(crate) marks: Arc<super::pg_listen::Marks>,
}

/// Builds a [`PostgresStore`].
#[derive(Debug)]
pub struct PostgresStoreBuilder {
    pool: PgPool,
    schema: String,
    table: String,
    change_poll: std::time::Duration,
    notify_changes: bool,
}

impl PostgresStoreBuilder {
    /// The longest a request waiting for a running duplicate's answer (a route's `wait`) goes
    /// without looking at the store again, when no notification woke it (default 1 s;
    /// a `LISTEN` connection wakes waiters when a record changes, so this only bounds how late a lost notification is found). At least 10 ms.
    #[must_use]
    pub fn change_poll(mut self, every: std::time::Duration) -> Self {
        self.change_poll = every.max(std::time::Duration::from_millis(10));
        self
    }

    /// Whether completes and releases send a notification (`pg_notify`) that wakes the
    /// requests waiting on the record, in every instance (default `true`). Turn it off where
    /// `LISTEN` cannot work (a pooler in transaction mode between the application and the
    /// database): waiters in other instances then find the answer by polling every
    /// [`change_poll`](Self::change_poll), which should then be short. Each notification costs
    /// its transaction a moment on PostgreSQL's notification queue at commit (BENCHMARKS.md).
    #[must_use]
    pub fn notify_changes(mut self, on: bool) -> Self {
        self.notify_changes = on;
        self
    }

    /// The schema holding the table (default `public`); created by [`PostgresStore::migrate`].
    #[must_use]
    pub fn schema(mut self, schema: &str) -> Self {
        schema.clone_into(&mut self.schema);
        self
    }

    /// The table's name (default `idempotency_records`).
    #[must_use]
    pub fn table(mut self, table: &str) -> Self {
        table.clone_into(&mut self.table);
        self
    }

    /// Checks the names and prepares the statements.
    ///
    /// # Errors
    /// [`SetupError::InvalidIdentifier`] for a schema or table that is not `[a-z_][a-z0-9_]*`.
    pub fn build(self) -> Result<PostgresStore, SetupError> {
        let schema = identifier(&self.schema)?;
        let name = identifier(&self.table)?;
        let sql = Statements::new(&schema, &name);
        let marks = Arc::new(super::pg_listen::Marks::new(
            self.notify_changes,
            &schema,
            &name,
        ));
        let changes = super::pg_listen::changes(
            &self.pool,
            sql.channel.clone(),
            self.change_poll,
            Arc::clone(&marks),
            Arc::clone(&sql.mark_waited),
        );
        Ok(PostgresStore {
            pool: self.pool,
            sql: Arc::new(sql),
            changes,
            marks,
            sent: Arc::default(),
            pin_isolation: Arc::default(),
            functions_ready: Arc::default(),
            server_utf8: Arc::default(),
            fenced: Arc::new(super::FencedConns::new(true)),
        })
    }
}

#[derive(Debug)]
pub(crate) struct Statements {
    schema: String,
    name: String,
    pub(crate) table: String,
    /// The channel of change notifications (`pg_listen`).
    pub(crate) channel: String,
    claim: Arc<str>,
    pub(crate) tx_read: Arc<str>,
    pub(crate) tx_claim: Arc<str>,
    take_over: Arc<str>,
    complete: Arc<str>,
    complete_quiet: Arc<str>,
    release: Arc<str>,
    release_quiet: Arc<str>,
    pub(crate) mark_waited: Arc<str>,
    extend: Arc<str>,
    purge: Arc<str>,
    get: Arc<str>,
    delete: Arc<str>,
}

impl Statements {
    fn new(schema: &str, name: &str) -> Self {
        let t = format!("{schema}.{name}");
        let channel = super::pg_listen::channel(&t);
        // Wakes the record's waiters, in this and every other instance, when the statement
        // that changed it commits (`pg_listen`); one row either way when it applied.
        // One row when the statement applied, either way; the notification only for a record
        // a waiter marked (`waited`, migration 4).
        let notify_sql = format!(
            "SELECT (SELECT count(*) FROM (SELECT pg_notify('{channel}', {}) WHERE changed.waited) n) FROM changed",
            super::pg_listen::change_id_sql("changed.scope", "changed.key")
        );
        let s = |sql: &str| -> Arc<str> {
            sql.replace("{t}", &t)
                .replace("{now}", NOW)
                .replace("{notify}", &notify_sql)
                .replace("{quiet}", "SELECT 1 FROM changed")
                .into()
        };
        Statements {
            schema: schema.to_owned(),
            name: name.to_owned(),
            // Closes the check-then-insert race: the INSERT … ON CONFLICT DO NOTHING is the
            // claim itself, so of N concurrent claimers exactly one inserts. When the row is
            // already visible (every replay), the INSERT gets no input row at all: no
            // speculative insertion, no row lock, no transaction id, no WAL (unlike
            // `ON CONFLICT DO UPDATE … WHERE false`, which locks the row). Under READ
            // COMMITTED, a row committed by a concurrent claimer after this statement's
            // snapshot is invisible to `existing` yet conflicts in the INSERT: then no row
            // comes back and the caller loops (bounded).
            claim: s("WITH existing AS (
                    SELECT fingerprint, done, token, expires_at, locked_until, status, headers, body, oversized
                    FROM {t} WHERE scope = $1 AND key = $2),
                ins AS (
                    INSERT INTO {t} (scope, key, fingerprint, done, token, locked_until, created_at, expires_at)
                    SELECT $1, $2, $3, false, $4,
                           {now} + $5::float8 * interval '1 millisecond', {now},
                           {now} + $6::float8 * interval '1 millisecond'
                    WHERE NOT EXISTS (SELECT 1 FROM existing)
                    ON CONFLICT (scope, key) DO NOTHING
                    RETURNING locked_until)
                SELECT true AS inserted, NULL::bytea AS fingerprint, false AS done, NULL::uuid AS token,
                       false AS expired, false AS lease_over, 0::int8 AS retry_ms,
                       (extract(epoch FROM locked_until) * 1000)::int8 AS locked_until_ms,
                       NULL::int4 AS status, NULL::bytea AS headers, NULL::bytea AS body, NULL::int8 AS oversized
                FROM ins
                UNION ALL
                SELECT false, fingerprint, done, token,
                       expires_at <= {now},
                       (NOT done AND locked_until <= {now}),
                       COALESCE(GREATEST(0, extract(epoch FROM (COALESCE(locked_until, expires_at) - {now})) * 1000), 0)::int8,
                       0::int8, status, headers, body, oversized
                FROM existing"),
            // Read-only, outside any transaction, before a single-commit claim: settles replays
            // (transactional mode's fast path), and, when there is no
            // committed record, whether another open transaction holds the key (its advisory
            // lock, see `tx_claim`, taken and let go within this statement: `held` true means
            // a first attempt is running, and its uncommitted claim is what the read cannot
            // see). The lock is evaluated only on the no-record branch.
            tx_read: s("WITH r AS (
                    SELECT fingerprint, done, token, expires_at <= {now} AS expired,
                        (NOT done AND locked_until <= {now}) AS lease_over,
                        COALESCE(GREATEST(0, extract(epoch FROM (COALESCE(locked_until, expires_at) - {now})) * 1000), 0)::int8 AS retry_ms,
                        status, headers, body, oversized
                    FROM {t} WHERE scope = $1 AND key = $2)
                SELECT r.*, false AS held FROM r
                UNION ALL
                SELECT NULL::bytea, false, NULL::uuid, false, false, 0::int8,
                       NULL::int4, NULL::bytea, NULL::bytea, NULL::int8,
                       NOT pg_try_advisory_xact_lock($3)
                WHERE NOT EXISTS (SELECT 1 FROM r)"),
            // The claim inside a business transaction (single commit). A transaction-scoped
            // advisory lock on the key ($7) stands for the uncommitted claim row: only its
            // holder inserts, so a duplicate never blocks on that row's unique-index entry (a
            // wait that would last as long as the handler) and instead learns at once that the
            // key is held (`locked` false, no row: the caller waits, bounded, or answers 409).
            // Try-lock never waits and never touches other keys. The lock CTE is volatile, so
            // it is evaluated once, before the INSERT that reads it.
            tx_claim: s("WITH lock AS MATERIALIZED (
                    SELECT pg_try_advisory_xact_lock($7) AS got),
                existing AS (
                    SELECT fingerprint, done, token, expires_at, locked_until, status, headers, body, oversized
                    FROM {t} WHERE scope = $1 AND key = $2),
                ins AS (
                    INSERT INTO {t} (scope, key, fingerprint, done, token, locked_until, created_at, expires_at)
                    SELECT $1, $2, $3, false, $4,
                           {now} + $5::float8 * interval '1 millisecond', {now},
                           {now} + $6::float8 * interval '1 millisecond'
                    FROM lock WHERE lock.got
                      AND NOT EXISTS (SELECT 1 FROM existing)
                    ON CONFLICT (scope, key) DO NOTHING
                    RETURNING locked_until)
                SELECT true AS inserted, true AS locked, NULL::bytea AS fingerprint, false AS done,
                       NULL::uuid AS token, false AS expired, false AS lease_over, 0::int8 AS retry_ms,
                       (extract(epoch FROM locked_until) * 1000)::int8 AS locked_until_ms,
                       NULL::int4 AS status, NULL::bytea AS headers, NULL::bytea AS body, NULL::int8 AS oversized
                FROM ins
                UNION ALL
                SELECT false, lock.got, fingerprint, done, token,
                       expires_at <= {now},
                       (NOT done AND locked_until <= {now}),
                       COALESCE(GREATEST(0, extract(epoch FROM (COALESCE(locked_until, expires_at) - {now})) * 1000), 0)::int8,
                       0::int8, status, headers, body, oversized
                FROM existing, lock
                UNION ALL
                SELECT false, false, NULL, false, NULL, false, false, 0, 0, NULL, NULL, NULL, NULL
                FROM lock WHERE NOT lock.got AND NOT EXISTS (SELECT 1 FROM existing)"),
            // The rare path: take over an expired record, or a lease that ran out (the caller
            // checked the fingerprint on the row it read). Compare-and-swap on the old token
            // closes the race between two retries taking over at once: only one UPDATE matches
            // the old token, and a row whose token is unchanged still has the fingerprint that
            // was checked (every claim or take-over writes a new token); the time conditions are
            // re-checked because the holder may have extended or completed meanwhile.
            //
            // It never waits on the row's lock: an owner stalled between its fenced complete
            // (which locks the row) and its COMMIT holds that lock until its session ends, and
            // a take-over queued behind it would hold a pooled connection for as long, inside
            // an execution nobody can cancel. `FOR UPDATE NOWAIT` fails at once instead
            // (SQLSTATE 55P03), which the caller answers as in progress.
            take_over: s("WITH target AS MATERIALIZED (
                    SELECT 1 FROM {t}
                    WHERE scope = $1 AND key = $2 AND token = $7
                      AND (expires_at <= {now} OR (NOT done AND locked_until <= {now}))
                    FOR UPDATE NOWAIT)
                UPDATE {t} SET fingerprint = $3, done = false, token = $4,
                    locked_until = {now} + $5::float8 * interval '1 millisecond',
                    created_at = {now}, completed_at = NULL,
                    status = NULL, headers = NULL, body = NULL, oversized = NULL,
                    expires_at = {now} + $6::float8 * interval '1 millisecond'
                WHERE scope = $1 AND key = $2 AND token = $7
                  AND (expires_at <= {now} OR (NOT done AND locked_until <= {now}))
                  AND EXISTS (SELECT 1 FROM target)
                RETURNING (extract(epoch FROM locked_until) * 1000)::int8"),
            // Fenced: a stale owner (its lease taken over) matches no row and cannot overwrite.
            // The claim already set expires_at to now + lease + ttl, so for a handler that
            // finishes within its lease the GREATEST leaves the indexed column unchanged and
            // the update can be HOT (no index insertions; see the fillfactor migration).
            // Its notification is sent with it (one row when it applied, none when fenced out).
            complete: s("WITH changed AS (UPDATE {t} SET done = true, status = $4, headers = $5, body = $6,
                    oversized = $7, completed_at = {now}, locked_until = NULL,
                    expires_at = GREATEST(expires_at, {now} + $8::float8 * interval '1 millisecond')
                WHERE scope = $1 AND key = $2 AND token = $3 AND NOT done AND expires_at > {now}
                RETURNING scope, key, waited)
                {notify}"),
            // The same without the `waited` column (a table migration 4 has not reached yet, or
            // notifications turned off): nothing wakes other instances' waiters but polling.
            complete_quiet: s("WITH changed AS (UPDATE {t} SET done = true, status = $4, headers = $5, body = $6,
                    oversized = $7, completed_at = {now}, locked_until = NULL,
                    expires_at = GREATEST(expires_at, {now} + $8::float8 * interval '1 millisecond')
                WHERE scope = $1 AND key = $2 AND token = $3 AND NOT done AND expires_at > {now}
                RETURNING scope, key)
                {quiet}"),
            // Fenced like complete: a stale owner cannot delete the new owner's record.
            release: s("WITH changed AS (DELETE FROM {t}
                WHERE scope = $1 AND key = $2 AND token = $3 AND NOT done AND expires_at > {now}
                RETURNING scope, key, waited)
                {notify}"),
            release_quiet: s("WITH changed AS (DELETE FROM {t}
                WHERE scope = $1 AND key = $2 AND token = $3 AND NOT done AND expires_at > {now}
                RETURNING scope, key)
                {quiet}"),
            // A request starts waiting on this record: its complete or release will notify.
            mark_waited: s("UPDATE {t} SET waited = true
                WHERE scope = $1 AND key = $2 AND NOT done AND NOT waited AND expires_at > {now}"),
            // Fenced heartbeat; keeps the record alive at least as long as its lease. Like the
            // take-over, it never waits on the row's lock: the lock's holder is almost always
            // this execution's own complete on the two-commit path, its COMMIT on its way (or
            // stalled), and a heartbeat queued behind it would hold a pooled connection and
            // then extend a lease its owner may have given up. 55P03 instead: unavailable,
            // and the heartbeat tries again.
            extend: s("WITH target AS MATERIALIZED (
                    SELECT 1 FROM {t}
                    WHERE scope = $1 AND key = $2 AND token = $3 AND NOT done AND expires_at > {now}
                    FOR UPDATE NOWAIT)
                UPDATE {t} SET locked_until = {now} + $4::float8 * interval '1 millisecond',
                    expires_at = GREATEST(expires_at, {now} + $4::float8 * interval '1 millisecond')
                WHERE scope = $1 AND key = $2 AND token = $3 AND NOT done AND expires_at > {now}
                  AND EXISTS (SELECT 1 FROM target)
                RETURNING (extract(epoch FROM locked_until) * 1000)::int8"),
            // Bounded batch; SKIP LOCKED so concurrent sweepers (one per instance) and claims
            // never wait on each other; the outer re-check skips rows taken over meanwhile.
            purge: s("DELETE FROM {t} WHERE (scope, key) IN (
                    SELECT scope, key FROM {t} WHERE expires_at <= {now}
                    LIMIT $1 FOR UPDATE SKIP LOCKED)
                AND expires_at <= {now}"),
            get: s("SELECT fingerprint, done, token,
                    (extract(epoch FROM locked_until) * 1000)::int8 AS locked_until,
                    status, headers, body, oversized,
                    (extract(epoch FROM created_at) * 1000)::int8 AS created_at,
                    (extract(epoch FROM completed_at) * 1000)::int8 AS completed_at,
                    (extract(epoch FROM expires_at) * 1000)::int8 AS expires_at
                FROM {t} WHERE scope = $1 AND key = $2 AND expires_at > {now}"),
            // Done, expired, or forced: an in-progress record under its ttl needs `force`.
            delete: s("DELETE FROM {t} WHERE scope = $1 AND key = $2
                    AND (done OR expires_at <= {now} OR $3)
                RETURNING fingerprint, done, token,
                    (extract(epoch FROM locked_until) * 1000)::int8 AS locked_until,
                    status, headers, body, oversized,
                    (extract(epoch FROM created_at) * 1000)::int8 AS created_at,
                    (extract(epoch FROM completed_at) * 1000)::int8 AS completed_at,
                    (extract(epoch FROM expires_at) * 1000)::int8 AS expires_at"),
            table: t,
            channel,
        }
    }
}

impl PostgresStore {
    /// A store on `pool` with the default schema (`public`) and table (`idempotency_records`).
    ///
    /// # Errors
    /// Never for the defaults; see [`PostgresStoreBuilder::build`].
    pub fn new(pool: PgPool) -> Result<Self, SetupError> {
        Self::builder(pool).build()
    }

    /// Starts a builder to choose the schema and table.
    pub fn builder(pool: PgPool) -> PostgresStoreBuilder {
        PostgresStoreBuilder {
            pool,
            schema: "public".into(),
            table: "idempotency_records".into(),
            change_poll: std::time::Duration::from_millis(1000),
            notify_changes: true,
        }
    }

    /// Creates the schema if needed and runs the store's migrations (safe to call from every
    /// instance at start-up: sqlx serialises concurrent runs with an advisory lock). Applied
    /// versions are tracked in `<schema>.<table>_migrations`, apart from your own migrations.
    /// Besides the table and its expiry index they create two functions beside the table,
    /// `<table>_claim_first` and `<table>_complete`, which transactional mode calls (so its
    /// claim and complete can share a round trip with BEGIN and COMMIT); transactional
    /// executions fail (503, with an error in the log naming this method) until they exist.
    ///
    /// # Errors
    /// [`SetupError::Database`] or [`SetupError::Migrate`].
    pub async fn migrate(&self) -> Result<(), SetupError> {
        let sql = include_str!("../../../migrations/postgres/0001_create_records.sql")
            .replace("{table}", &self.sql.table)
            .replace("{name}", &self.sql.name);
        let fillfactor = include_str!("../../../migrations/postgres/0002_fillfactor.sql")
            .replace("{table}", &self.sql.table);
        let functions = include_str!("../../../migrations/postgres/0003_batch_functions.sql")
            .replace("{table}", &self.sql.table);
        let waited = include_str!("../../../migrations/postgres/0004_waited.sql")
            .replace("{table}", &self.sql.table);
        let mut migrator = Migrator::with_migrations(vec![
            Migration::new(
                1,
                "create records".into(),
                MigrationType::Simple,
                AssertSqlSafe(sql).into_sql_str(),
                false,
            ),
            Migration::new(
                2,
                "fillfactor for HOT completes".into(),
                MigrationType::Simple,
                AssertSqlSafe(fillfactor).into_sql_str(),
                false,
            ),
            Migration::new(
                3,
                "claim and complete as functions".into(),
                MigrationType::Simple,
                AssertSqlSafe(functions).into_sql_str(),
                false,
            ),
            Migration::new(
                4,
                "records waited on".into(),
                MigrationType::Simple,
                AssertSqlSafe(waited).into_sql_str(),
                false,
            ),
        ]);
        migrator
            .dangerous_set_table_name(format!("{}.{}_migrations", self.sql.schema, self.sql.name));
        migrator.create_schema(self.sql.schema.clone());
        migrator.run(&self.pool).await?;
        self.marks.migrated();
        Ok(())
    }

    /// The complete statement: notifying a record's waiters once the table can say whether
    /// anyone waits (migration 4).
    async fn complete_sql(&self) -> Arc<str> {
        if self.marks.known_present(&self.pool) {
            Arc::clone(&self.sql.complete)
        } else {
            Arc::clone(&self.sql.complete_quiet)
        }
    }

    /// The release statement, as [`PostgresStore::complete_sql`].
    async fn release_sql(&self) -> Arc<str> {
        if self.marks.known_present(&self.pool) {
            Arc::clone(&self.sql.release)
        } else {
            Arc::clone(&self.sql.release_quiet)
        }
    }

    /// [`Store::claim`](crate::Store::claim) on a connection or transaction you provide.
    ///
    /// Outside a transaction each statement runs at the session's default isolation. Where
    /// that is stricter than READ COMMITTED (REPEATABLE READ, SERIALIZABLE), a claim that
    /// meets a concurrent claimer fails with a serialization error instead of reading its
    /// row; the first time that happens, this store pins READ COMMITTED for its claims from
    /// then on, as the transactional path always does: each claim runs in
    /// `BEGIN ISOLATION LEVEL READ COMMITTED` … `COMMIT`, two more round trips (set the pool's
    /// `default_transaction_isolation` to `read committed` to avoid them).
    ///
    /// Inside a transaction of yours, the claim runs at your transaction's isolation, and a
    /// serialization failure (SQLSTATE 40001) is returned to you as it is, for you to run your
    /// transaction again.
    ///
    /// # Errors
    /// As [`Store::claim`](crate::Store::claim).
    pub async fn claim_on(
        &self,
        conn: &mut PgConnection,
        req: ClaimRequest<'_>,
    ) -> Result<ClaimOutcome, StoreError> {
        self.claim_reported(conn, req)
            .await
            .map(|(outcome, _)| outcome)
    }

    /// [`PostgresStore::claim_on`], and how long a replayed record still lives
    /// ([`Store::claim_with_expiry`](crate::Store::claim_with_expiry)).
    pub(crate) async fn claim_reported(
        &self,
        conn: &mut PgConnection,
        req: ClaimRequest<'_>,
    ) -> Result<(ClaimOutcome, Option<std::time::Duration>), StoreError> {
        use std::sync::atomic::Ordering;
        // The first claim starts finding out (in the background) whether completes can notify,
        // so that its own complete, a handler's run later, already knows.
        let _ = self.marks.known_present(&self.pool);
        if sqlx::Connection::is_in_transaction(&*conn) {
            return self.claim_loop(conn, &req).await;
        }
        if !self.pin_isolation.load(Ordering::Relaxed) {
            match self.claim_loop(conn, &req).await {
                // A serialization failure of the claim itself (not a deadlock, which READ
                // COMMITTED can meet too): the session's isolation is stricter.
                Err(e) if has_sqlstate(&e, "40001") => {
                    if !self.pin_isolation.swap(true, Ordering::Relaxed) {
                        tracing::warn!(
                            error = %e,
                            "idempotency: PostgreSQL's default isolation is stricter than READ COMMITTED; claims now pin READ COMMITTED in a transaction of their own (two more round trips each; set default_transaction_isolation = 'read committed' for this pool to avoid them)"
                        );
                    }
                }
                other => return other,
            }
        }
        self.sent.bump();
        let mut tx =
            sqlx::Connection::begin_with(&mut *conn, "BEGIN ISOLATION LEVEL READ COMMITTED")
                .await
                .map_err(db_error)?;
        let outcome = self.claim_loop(&mut tx, &req).await;
        self.sent.bump();
        if outcome.is_ok() {
            tx.commit().await.map_err(db_error)?;
        } else {
            tx.rollback().await.map_err(db_error)?;
        }
        outcome
    }

    /// The claim itself: the claim statement, a take-over where the row allows, again while
    /// a concurrent claimer's row was invisible to the statement's snapshot (bounded). A
    /// serialization failure is returned as it is (see [`PostgresStore::claim_on`]).
    async fn claim_loop(
        &self,
        conn: &mut PgConnection,
        req: &ClaimRequest<'_>,
    ) -> Result<(ClaimOutcome, Option<std::time::Duration>), StoreError> {
        let fp = req.fingerprint.to_stored();
        for _ in 0..MAX_CLAIM_ATTEMPTS {
            let token = LeaseToken::generate();
            self.sent.bump();
            let row = claim_query(&self.sql.claim, req, &fp, token)
                .fetch_optional(&mut *conn)
                .await
                .map_err(db_error)?;
            let Some(row) = row else { continue };
            if row.try_get::<bool, _>("inserted").map_err(db_error)? {
                let until: i64 = row.try_get("locked_until_ms").map_err(db_error)?;
                return Ok((claimed(token, until, false), None));
            }
            match Self::decide_row(&row, req)? {
                Decision::Report(outcome, lives) => return Ok((outcome, lives)),
                Decision::TakeOver(old) => {
                    if let Some(outcome) = self.take_over(conn, req, token, old).await? {
                        return Ok((outcome, None));
                    }
                }
            }
        }
        Err(StoreError::unavailable(Contention))
    }
}

impl PostgresStore {
    /// Takes over a record whose lease or ttl ran out (the `take_over` statement): the new
    /// claim; in progress when another transaction holds the row's lock (an owner between its
    /// complete and its COMMIT: the take-over never waits for it); `None` when another claimer
    /// took it over first (read it again).
    pub(crate) async fn take_over(
        &self,
        conn: &mut PgConnection,
        req: &ClaimRequest<'_>,
        token: LeaseToken,
        old: LeaseToken,
    ) -> Result<Option<ClaimOutcome>, StoreError> {
        match self
            .claim_write(conn, &self.sql.take_over, req, token, Some(old))
            .await
        {
            Ok(Some(until)) => Ok(Some(claimed(token, until, true))),
            Ok(None) => Ok(None),
            // lock_not_available, from FOR UPDATE NOWAIT.
            Err(e) if has_sqlstate(&e, "55P03") => Ok(Some(ClaimOutcome::InProgress {
                retry_after: ROW_LOCKED_RETRY_AFTER,
            })),
            Err(e) => Err(e),
        }
    }
}

/// What a request whose record's row is locked by an open transaction is told to wait: that
/// transaction commits, or its session ends within a lease of going idle.
const ROW_LOCKED_RETRY_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

/// A claim statement (`claim`, `tx_claim`) with its common parameters bound: scope, key,
/// fingerprint, the new token, the lease and the initial expiry (lease + ttl).
pub(crate) fn claim_query<'q>(
    sql: &Arc<str>,
    req: &ClaimRequest<'q>,
    fingerprint: &'q [u8],
    token: LeaseToken,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    sqlx::query(q(sql))
        .bind(req.key.scope.as_str())
        .bind(req.key.key.as_str())
        .bind(fingerprint)
        .bind(token.as_uuid())
        .bind(millis(req.lease))
        .bind(millis(req.lease.saturating_add(req.ttl)))
}

sql_store_common!(PostgresStore, PgPool, sqlx::Postgres, PgConnection);
