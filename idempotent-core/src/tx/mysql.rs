//! Transactional mode on MySQL and MariaDB: how the MySQL store opens a handler's transaction
//! (READ COMMITTED, an idle limit) and claims and completes inside it, with a named lock
//! (`GET_LOCK`) standing for a key's uncommitted claim.
//!
//! Why a named lock: a duplicate's `INSERT` meets the first attempt's uncommitted row on the
//! primary key and InnoDB makes it wait for that row's lock, as long as the first
//! transaction lives (the handler's whole run) or `innodb_lock_wait_timeout` (whole seconds,
//! at least 1 on MySQL, 50 by default). `GET_LOCK(name, 0)` never waits: only its holder
//! inserts, a duplicate learns at once that the key is held and polls for the route's `wait`
//! (50 ms by default) under the library's control, and the handler's own statements keep the
//! session's lock wait timeout untouched. The alternative, a per-statement lock wait timeout,
//! needs MariaDB's `SET STATEMENT … FOR` (MySQL has no such syntax) and cannot go below one
//! second on MySQL. The cost: a named lock belongs to the session, not the transaction, so
//! the transaction's end is followed by `RELEASE_LOCK` (in the same round trip as COMMIT or
//! ROLLBACK), and a transaction dropped without that closes its connection (the server then
//! releases everything the session held). Named locks are server-wide: the name is 40 hex
//! digits of SHA-256 over the table, scope and key, so two stores share one only when
//! they have the same table name in two databases and a request of the same scope and key,
//! and then a duplicate merely waits or gets 409.

use super::held::Held;
use super::{FinishError, FirstClaim, ReadFirst, TxDatabase};
use crate::store::MySqlStore;
use crate::store::fence::LeaseToken;
use crate::store::record::{RecordKey, StoredOutcome};
use crate::store::sql::mysql::Inserted;
use crate::store::sql::{Contention, Decision, MAX_CLAIM_ATTEMPTS, claimed, db_error, q};
use crate::store::{ClaimOutcome, ClaimRequest, StoreError};
use sqlx::mysql::MySqlConnection;
use sqlx::{AssertSqlSafe, SqlSafeStr};
use std::time::Duration;

/// How every transaction on this store begins: READ COMMITTED for this transaction only,
/// whatever the session's default (the claim's retry loop and the fenced complete rely on
/// each statement seeing what committed before it), with the session's autocommit off until
/// it ends. Why: InnoDB ends a transaction it picks as a deadlock's victim (and, with
/// `innodb_rollback_on_timeout`, one whose lock wait timed out) by rolling it back whole. With
/// autocommit on, the statements a handler runs after that error (if it goes on) would each
/// commit on their own; with it off they open a new transaction, which only the library's
/// COMMIT ends. In single commit the claim rolled back with the rest, so the fenced complete
/// is refused and nothing commits. In two commits the claim committed before, so the
/// transaction also carries a marker: see [`MARK`].
const BEGIN: &str = "SET @idempotent_autocommit = @@SESSION.autocommit, SESSION autocommit = 0; \
    SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION";

/// What a two-commit (or unprotected) transaction's BEGIN does first: a row in a temporary
/// table of the session (InnoDB: transactional), inserted inside the transaction after
/// [`BEGIN`]. A rollback by the server takes the row with it; a commit (the handler's own
/// `COMMIT`, or DDL, which MySQL commits implicitly) keeps it. Before the complete, the row
/// says which: gone, nothing of the handler can commit (503, the claim released); there,
/// the complete and COMMIT go ahead (after an implicit commit the handler's earlier writes
/// are already in, as on PostgreSQL after a `COMMIT` of the handler's own). The table is
/// created outside any transaction (`CREATE TEMPORARY TABLE` commits nothing; it needs the
/// `CREATE TEMPORARY TABLES` privilege), and emptied before the transaction begins, so a row
/// a committed transaction left is never taken for this one's.
const MARK: &str = "CREATE TEMPORARY TABLE IF NOT EXISTS idempotent_tx_marker \
    (id TINYINT PRIMARY KEY) ENGINE = InnoDB; DELETE FROM idempotent_tx_marker; ";

/// Inserts the marker row, inside the transaction (see [`MARK`]).
const MARK_ROW: &str = "; INSERT INTO idempotent_tx_marker VALUES (1)";

/// The handler's transaction was rolled back by the server while it ran.
#[derive(Debug, thiserror::Error)]
#[error(
    "the server rolled the handler's transaction back (a deadlock's victim, or a lock wait timeout with innodb_rollback_on_timeout); nothing of it committed"
)]
struct RolledBack;

/// How long a two-commit session may idle between its complete and its COMMIT (both sent at
/// once unless the process stalls): past it the server ends the session, which releases the
/// record's row lock that the complete took.
const COMPLETE_IDLE_SECS: u64 = 10;

/// Puts back the session's autocommit that [`BEGIN`] turned off.
const RESTORE_AUTOCOMMIT: &str = "SET SESSION autocommit = @idempotent_autocommit";

/// Puts back the session's idle limit that [`TxDatabase::begin_tx`] lowered.
const RESTORE_IDLE: &str = "SET SESSION wait_timeout = @idempotent_wait_timeout";

impl TxDatabase for sqlx::MySql {
    type Store = MySqlStore;
    const LABEL: &'static str = "MySQL";
    const ALWAYS_READ_FIRST: bool = false;

    /// `SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION` in one round trip,
    /// and, with `idle` (single commit: the lease), the session's `wait_timeout` lowered to it
    /// (whole seconds, rounded up) until the transaction ends, so a session frozen inside it
    /// (a stopped process) is ended by the server, which rolls its claim back and releases
    /// its named lock. (`wait_timeout` exists on MySQL and MariaDB alike; MariaDB's
    /// `idle_transaction_timeout` does not exist on MySQL.)
    async fn begin_tx(
        store: &MySqlStore,
        idle: Option<Duration>,
        conn: Option<sqlx::pool::PoolConnection<sqlx::MySql>>,
    ) -> Result<Held<sqlx::MySql>, StoreError> {
        let conn = match conn {
            Some(conn) => conn,
            None => store.pool.acquire().await.map_err(db_error)?,
        };
        let mut begin = String::new();
        if idle.is_none() {
            begin.push_str(MARK);
        }
        if let Some(idle) = idle {
            let secs = idle.as_secs() + u64::from(idle.subsec_nanos() > 0);
            begin.push_str(&format!(
                "SET @idempotent_wait_timeout = @@SESSION.wait_timeout, SESSION wait_timeout = {}; ",
                secs.clamp(1, 31_536_000)
            ));
        }
        begin.push_str(BEGIN);
        if idle.is_none() {
            begin.push_str(MARK_ROW);
        }
        store.sent.bump();
        match Held::begin(conn, AssertSqlSafe(begin).into_sql_str()).await {
            Ok(mut tx) => {
                tx.marked = idle.is_none();
                tx.after = Some(if idle.is_some() {
                    format!("{RESTORE_AUTOCOMMIT}; {RESTORE_IDLE}")
                } else {
                    RESTORE_AUTOCOMMIT.to_owned()
                });
                Ok(tx)
            }
            Err((e, mut conn)) => {
                // The batch may have changed the session before it failed: never reuse it.
                conn.close_on_drop();
                Err(db_error(e))
            }
        }
    }

    async fn acquire(
        store: &MySqlStore,
    ) -> Result<sqlx::pool::PoolConnection<sqlx::MySql>, StoreError> {
        store.pool.acquire().await.map_err(db_error)
    }

    async fn read<'a>(
        store: &'a MySqlStore,
        conn: &'a mut MySqlConnection,
        req: ClaimRequest<'a>,
    ) -> Result<ReadFirst, StoreError> {
        let Some(row) = store.read_row(conn, &req).await? else {
            return Ok(ReadFirst::Absent);
        };
        match MySqlStore::decide_row(&row, &req)? {
            Decision::Report(outcome, lives) => Ok(ReadFirst::Settled(outcome, lives)),
            Decision::TakeOver(_) => Ok(ReadFirst::Stale),
        }
    }

    /// After a read that found no record: BEGIN (with the idle limit), then the key's named
    /// lock and the insert in one statement (`tx_insert`): two round trips. Anything but an
    /// insert (another session holds the key, or a record appeared since the read) rolls back,
    /// releasing the lock if it was taken, and the ordinary path settles the request.
    async fn claim_first(
        store: &MySqlStore,
        conn: sqlx::pool::PoolConnection<sqlx::MySql>,
        idle: Duration,
        req: ClaimRequest<'_>,
    ) -> Result<FirstClaim<sqlx::MySql>, StoreError> {
        let mut tx = Self::begin_tx(store, Some(idle), Some(conn)).await?;
        let lock = lock_name(&store.sql.table, req.key);
        release_at_end(&mut tx, &lock);
        let token = LeaseToken::generate();
        let inserted = store
            .insert(&mut tx, &store.sql.tx_insert, &req, token, Some(&lock))
            .await;
        match inserted {
            Ok(Inserted::Claimed(_)) => Ok(FirstClaim::Claimed(tx, token)),
            Ok(Inserted::Duplicate | Inserted::NotLocked) => {
                Self::rollback_tx(tx).await.map_err(db_error)?;
                // The connection went back to the pool clean; the ordinary path takes one.
                Ok(FirstClaim::Fallback(Self::acquire(store).await?))
            }
            Err(e) => {
                let _ = Self::rollback_tx(tx).await;
                Err(e)
            }
        }
    }

    /// Reads the record first (a consistent read: no lock, so never a wait), then inserts
    /// only where there is none, as the holder of the key's named lock (`tx_insert`: the lock
    /// and the insert in one statement), or takes a stale record over once the lock is
    /// held. Never an insert over an existing row: InnoDB's duplicate check would wait for
    /// that row's lock (an owner between its complete and its COMMIT holds it). From the
    /// moment the lock may be taken, the transaction's end releases it (module docs).
    async fn claim_in(
        store: &MySqlStore,
        tx: &mut Held<sqlx::MySql>,
        req: ClaimRequest<'_>,
    ) -> Result<Option<ClaimOutcome>, StoreError> {
        let lock = lock_name(&store.sql.table, req.key);
        release_at_end(tx, &lock);
        let conn: &mut MySqlConnection = tx;
        // Whether this session holds the lock: taken at most once per transaction (a
        // session may hold a named lock several times, and the end releases it once).
        let mut locked = false;
        for _ in 0..MAX_CLAIM_ATTEMPTS {
            let token = LeaseToken::generate();
            let Some(row) = store.read_row(conn, &req).await? else {
                let inserted = if locked {
                    store
                        .insert(conn, &store.sql.insert, &req, token, None)
                        .await?
                } else {
                    store
                        .insert(conn, &store.sql.tx_insert, &req, token, Some(&lock))
                        .await?
                };
                match inserted {
                    Inserted::Claimed(until) => return Ok(Some(claimed(token, until, false))),
                    // The insert ran, so `GET_LOCK` had answered 1: the lock is ours, and a
                    // record appeared since the read: read it.
                    Inserted::Duplicate => locked = true,
                    // Another session holds the key (its claim uncommitted): the caller
                    // waits and calls again.
                    Inserted::NotLocked => return Ok(None),
                }
                continue;
            };
            match MySqlStore::decide_row(&row, &req)? {
                Decision::Report(outcome, _) => return Ok(Some(outcome)),
                Decision::TakeOver(old) => {
                    // Taking over writes the row: only the lock's holder may.
                    if !locked {
                        store.sent.bump();
                        let got: Option<i64> = sqlx::query_scalar(q(&store.sql.get_lock))
                            .bind(&lock)
                            .fetch_one(&mut *conn)
                            .await
                            .map_err(db_error)?;
                        if got != Some(1) {
                            return Ok(None);
                        }
                        locked = true;
                    }
                    if let Some(outcome) = store.take_over(conn, &req, token, old).await? {
                        return Ok(Some(outcome));
                    }
                }
            }
        }
        Err(StoreError::unavailable(Contention))
    }

    /// COMMIT and what must follow it (the lock's release, the session's settings put back)
    /// in one round trip.
    async fn commit_tx(tx: Held<sqlx::MySql>) -> Result<(), sqlx::Error> {
        let mut tx = tx;
        end(&mut tx, "COMMIT").await
    }

    /// ROLLBACK and what must follow it, in one round trip.
    async fn rollback_tx(tx: Held<sqlx::MySql>) -> Result<(), sqlx::Error> {
        let mut tx = tx;
        end(&mut tx, "ROLLBACK").await
    }

    /// The fenced complete (a prepared statement: its values are bound, not written into the
    /// text), then COMMIT and what must follow it (the lock's release, the session's settings
    /// put back) in one round trip: two round trips in single commit. A complete the fence
    /// refused never reaches the COMMIT. In two commits one more goes first: the marker's
    /// check (see [`MARK`]) and the session's idle limit lowered to 10 s until the end, so a
    /// process that stalls between the complete (which locks the record's row) and its
    /// COMMIT gives the row back that much later, not after the session's usual
    /// `wait_timeout` (8 hours by default).
    async fn complete_commit(
        store: &MySqlStore,
        tx: Held<sqlx::MySql>,
        key: &RecordKey,
        token: LeaseToken,
        outcome: &StoredOutcome,
        ttl: Duration,
    ) -> Result<(), FinishError<sqlx::MySql>> {
        let mut tx = tx;
        if tx.marked {
            // Two commits: no idle limit so far (the handler may idle, its claim's heartbeat
            // runs). The complete locks the record's row until COMMIT: a process that stalls
            // in between must not hold it (and the key) until the session's usual
            // `wait_timeout`, hours by default. In the same round trip, the marker: gone means
            // the server rolled the handler's transaction back (see [`MARK`]).
            store.sent.bump();
            let check = format!(
                "SET @idempotent_wait_timeout = @@SESSION.wait_timeout, SESSION wait_timeout = {COMPLETE_IDLE_SECS}; \
                 SELECT COUNT(*) FROM idempotent_tx_marker"
            );
            let marked: Result<i64, _> = match sqlx::raw_sql(AssertSqlSafe(check))
                .fetch_one(&mut *tx)
                .await
            {
                Ok(row) => sqlx::Row::try_get(&row, 0),
                Err(e) => Err(e),
            };
            let after = tx.after.get_or_insert_with(String::new);
            if after.is_empty() {
                after.push_str(RESTORE_IDLE);
            } else {
                after.push_str("; ");
                after.push_str(RESTORE_IDLE);
            }
            match marked {
                Ok(1) => {}
                Ok(_) => {
                    return Err(FinishError::Complete(
                        StoreError::unavailable(RolledBack),
                        tx,
                    ));
                }
                Err(e) => return Err(FinishError::Complete(db_error(e), tx)),
            }
        }
        match store.complete_on(&mut tx, key, token, outcome, ttl).await {
            Ok(()) => {}
            // Single commit: no one else can have taken over a claim that never committed;
            // the claim is gone because the server rolled the transaction back.
            Err(StoreError::StaleLease) if !tx.marked => {
                return Err(FinishError::Complete(
                    StoreError::unavailable(RolledBack),
                    tx,
                ));
            }
            Err(error) => return Err(FinishError::Complete(error, tx)),
        }
        store.sent.bump();
        // On failure `tx` is dropped with `after` still set, so its connection is closed; and
        // whether COMMIT applied is unknown.
        Self::commit_tx(tx)
            .await
            .map_err(|e| FinishError::Commit(db_error(e)))
    }

    /// The lease, and at least 10 s: past it the server has ended a single-commit session
    /// that stalled idle (the bound its BEGIN set), so no answer is coming; the floor keeps a
    /// COMMIT that is merely slow (a loaded disk) from being given up on.
    fn finish_bound(lease: Duration) -> Option<Duration> {
        Some(crate::engine::write_bound(lease))
    }
}

/// Ends `tx` with `verb` (COMMIT or ROLLBACK) and what must follow it on the session, in one
/// round trip. sqlx still counts the transaction: dropped, `tx` queues a ROLLBACK that does
/// nothing now (it goes out with the connection's next statement). If this fails, `tx` keeps
/// `after` and its drop closes the connection.
async fn end(tx: &mut Held<sqlx::MySql>, verb: &str) -> Result<(), sqlx::Error> {
    let sql = match tx.after.as_deref() {
        Some(after) => format!("{verb}; {after}"),
        None => verb.to_owned(),
    };
    sqlx::raw_sql(AssertSqlSafe(sql)).execute(&mut **tx).await?;
    tx.after = None;
    Ok(())
}

/// Makes the end of `tx` release the named lock `lock` (before what else must follow it).
fn release_at_end(tx: &mut Held<sqlx::MySql>, lock: &str) {
    let release = format!("DO RELEASE_LOCK('{lock}')");
    match &mut tx.after {
        Some(after) if after.contains(&release) => {}
        Some(after) => *after = format!("{release}; {after}"),
        None => tx.after = Some(release),
    }
}

/// The named lock that stands for a key's uncommitted claim: `idempotent:` and 40 hex digits
/// of SHA-256 over the table and the length-prefixed (scope, key) (51 characters: MySQL
/// takes at most 64), so keys never share a lock by concatenation. Only hex digits and the
/// prefix, so the name can be written into a statement's text.
fn lock_name(table: &str, key: &RecordKey) -> String {
    use sha2::{Digest, Sha256};
    use std::fmt::Write;
    let mut h = Sha256::new();
    for part in [table, key.scope.as_str(), key.key.as_str()] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    let digest = h.finalize();
    let mut name = String::with_capacity(51);
    name.push_str("idempotent:");
    for b in &digest[..20] {
        let _ = write!(name, "{b:02x}");
    }
    name
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{key::IdempotencyKey, scope::Scope};

    #[test]
    fn lock_names_are_short_plain_and_distinct() {
        let key = |scope: &str, key: &str| {
            RecordKey::new(
                Scope::new(scope).unwrap(),
                IdempotencyKey::parse(key.as_bytes()).unwrap(),
            )
        };
        let a = lock_name("t", &key("ab", "c"));
        assert_eq!(a.len(), 51);
        assert!(a[11..].bytes().all(|b| b.is_ascii_hexdigit()));
        // No collision by concatenation, across tables, or across scopes.
        assert_ne!(a, lock_name("t", &key("a", "bc")));
        assert_ne!(a, lock_name("u", &key("ab", "c")));
        assert_eq!(a, lock_name("t", &key("ab", "c")));
    }
}
