//! A transaction open on a pooled connection: what `sqlx::Transaction<'static, DB>` is, except
//! that it can also take over a transaction that a statement batch opened (PostgreSQL's
//! `BEGIN …; claim` in one round trip, see `tx/postgres.rs`) and give back the connection
//! when that batch failed, so the failed transaction is rolled back before the connection
//! returns to the pool.
//!
//! sqlx tracks a connection's transaction depth itself (its `TransactionManager`), and the
//! handler's savepoints (`tx.begin()`) rely on it, so every change of depth goes through it:
//! begin, commit and rollback here, and on drop a ROLLBACK queued on the connection, as
//! sqlx's own transaction does (PostgreSQL and MySQL send it with the pool's release ping, no
//! round trip of its own; SQLite's connection thread runs it next).

use sqlx::pool::PoolConnection;
use sqlx::{Database, SqlStr};
use sqlx_core::transaction::TransactionManager;

/// A transaction sqlx counts (depth one) on a pooled connection. Internal: named by
/// [`TxDatabase`](super::TxDatabase)'s hidden methods only.
#[doc(hidden)]
pub struct Held<DB: Database> {
    conn: PoolConnection<DB>,
    /// Statements that must follow the end of this transaction on its session (MySQL: the
    /// release of the key's named lock, the session's idle limit put back). Set: a drop
    /// without them closes the connection instead of returning it to the pool, and the
    /// server ends the session with everything it held.
    pub(crate) after: Option<String>,
    /// MySQL: the transaction holds a marker row that a rollback by the server removes (see
    /// `tx/mysql.rs`).
    #[cfg_attr(not(feature = "mysql"), allow(dead_code))]
    pub(crate) marked: bool,
    /// SQLite: this transaction's turn in the store's write queue, if it has one, given up
    /// when this is dropped: after COMMIT or ROLLBACK, or on a drop without them as soon as
    /// the ROLLBACK is sent (before it has run: the next turn may then wait in SQLite's busy
    /// handler for a moment). See `SqliteStoreBuilder::queue_transactions`.
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    pub(crate) turn: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl<DB: Database> Held<DB> {
    /// Sends `begin` (a `BEGIN`, possibly followed by more statements in the same simple
    /// query) on `conn`. On an error the connection comes back with the error: the batch
    /// may have left a failed transaction open on the server (sqlx counts none), which the
    /// caller must roll back before the connection goes back to the pool.
    ///
    /// Cancel-safe: if this future is dropped before the server answered, the connection is
    /// closed (the server then ends its session and whatever the batch began) instead of
    /// going back to the pool inside a transaction sqlx does not count.
    pub(crate) async fn begin(
        conn: PoolConnection<DB>,
        begin: SqlStr,
    ) -> Result<Self, (sqlx::Error, PoolConnection<DB>)> {
        let mut guard = CloseIfCancelled::new(conn);
        let begun = DB::TransactionManager::begin(guard.get(), Some(begin)).await;
        let conn = guard.disarm();
        match begun {
            Ok(()) => Ok(Held {
                conn,
                after: None,
                marked: false,
                turn: None,
            }),
            Err(e) => Err((e, conn)),
        }
    }

    /// Commits.
    pub async fn commit(mut self) -> Result<(), sqlx::Error> {
        DB::TransactionManager::commit(&mut self.conn).await
    }

    /// Rolls back.
    pub async fn rollback(mut self) -> Result<(), sqlx::Error> {
        DB::TransactionManager::rollback(&mut self.conn).await
    }
}

impl<DB: Database> Drop for Held<DB> {
    fn drop(&mut self) {
        if self.after.is_some() {
            self.conn.close_on_drop();
            return;
        }
        // As `sqlx::Transaction`: queued on the connection (PostgreSQL and MySQL send it with
        // the pool's release ping; SQLite's connection thread runs it next).
        if DB::TransactionManager::get_transaction_depth(&self.conn) > 0 {
            DB::TransactionManager::start_rollback(&mut self.conn);
        }
    }
}

impl<DB: Database> std::ops::Deref for Held<DB> {
    type Target = DB::Connection;
    fn deref(&self) -> &DB::Connection {
        &self.conn
    }
}

impl<DB: Database> std::ops::DerefMut for Held<DB> {
    fn deref_mut(&mut self) -> &mut DB::Connection {
        &mut self.conn
    }
}

/// A pooled connection that is closed instead of going back to the pool if it is dropped
/// before [`disarm`](Self::disarm): held across a statement whose future may be dropped
/// midway (a caller's timeout), which can leave the session inside a transaction.
pub(crate) struct CloseIfCancelled<DB: Database>(Option<PoolConnection<DB>>);

impl<DB: Database> CloseIfCancelled<DB> {
    pub(crate) fn new(conn: PoolConnection<DB>) -> Self {
        CloseIfCancelled(Some(conn))
    }

    /// The connection, to run the statement on.
    pub(crate) fn get(&mut self) -> &mut PoolConnection<DB> {
        self.0.as_mut().expect("held until disarmed")
    }

    /// The statement answered: the connection, free to go back to the pool.
    pub(crate) fn disarm(mut self) -> PoolConnection<DB> {
        self.0.take().expect("held until disarmed")
    }
}

impl<DB: Database> Drop for CloseIfCancelled<DB> {
    fn drop(&mut self) {
        if let Some(conn) = self.0.as_mut() {
            conn.close_on_drop();
        }
    }
}
