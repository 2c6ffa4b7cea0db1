//! Transactional mode (`docs/semantics.md#transactional-mode` in the repository): the handler
//! writes through a transaction on the store's own database, and its stored response commits
//! **with** those writes, in the same commit.
//!
//! Commit if and only if the response is stored: a stored response (2xx, 3xx, 4xx other than
//! 408/409/425/429) commits the handler's writes together with the record; a releasing one
//! (5xx, 408/409/425/429), a panic, a failed fence or a failed write rolls everything back.
//! The handler's response is never sent before COMMIT has succeeded.
//!
//! Two ways to get there ([`CommitPath`]):
//! - **single commit**: BEGIN → claim (the row is inserted inside the business transaction) →
//!   the handler's statements → complete → COMMIT. One commit per first execution; a crash
//!   rolls the claim back with everything else, so a retry runs at once, with no lease to wait
//!   for. A concurrent duplicate meets the uncommitted claim: on PostgreSQL it waits a short,
//!   bounded time ([`TxOptions::wait`], through a transaction-scoped advisory lock on the key,
//!   so the wait never applies to the handler's own statements and never holds up other keys),
//!   then gets the replay if the first committed meanwhile, else 409. MySQL and MariaDB do the
//!   same with a named lock (`GET_LOCK(…, 0)`, released with COMMIT or ROLLBACK). On SQLite the
//!   transaction holds the database's single write lock (`BEGIN IMMEDIATE`), so duplicates and
//!   every other writer wait for it (the busy timeout; a store built with
//!   `queue_transactions` has its own transactional executions take it in arrival order).
//!   SQLite has no idle limit, so there the library stops a handler still running at the end
//!   of its lease and rolls it back ([`Halted::OverLease`]; HTTP: 503).
//! - **two commits**: the claim commits alone (duplicates see it and get 409 at once) → BEGIN
//!   → handler → complete, fenced by the lease token, in the handler's transaction → COMMIT.
//!   For handlers that must not hold the claim row's lock (or the advisory lock) for long; a
//!   crash leaves the claim, whose lease expires. On SQLite this transaction is deferred: it
//!   takes the file's write lock at its first write, not at BEGIN, so a handler that works
//!   before it writes leaves the file to other writers meanwhile (it is still stopped at the
//!   end of its lease).
//!
//! A replay costs one read-only statement on either path (the record is read before any
//! transaction begins).
//!
//! On PostgreSQL, after a read that found no record, BEGIN and the claim go in one simple
//! query, and on both paths the complete, COMMIT and an empty BEGIN go in another (its
//! ROLLBACK rides on the pool's release ping): a single-commit first execution is five round
//! trips, the handler's statements included once. The claim and the complete there are calls
//! of two functions the store's migrations create (`<table>_claim_first`, `<table>_complete`),
//! whose statements run from plans the session keeps; their arguments are written into the
//! text (bytes as hex digits, text as ASCII with Unicode escapes), since the simple
//! protocol has no parameters. The read before tells
//! when another transaction holds the key (a first attempt running): the claim then goes the
//! ordinary way, which waits for it. A claim that did not insert, and a
//! complete the fence refused, raise an error of their own (SQLSTATE `IDM01`, `IDM02`), so
//! nothing after them runs (see SECURITY.md for what the server then logs).

use std::time::Duration;

/// How a transactional execution commits (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CommitPath {
    /// The claim, the handler's writes and the stored response in one transaction: one commit.
    Single,
    /// The claim in its own commit, then the handler's writes and the stored response in a
    /// second, fenced by the lease.
    Two,
}

impl CommitPath {
    /// `"single"` or `"two"`, as the attribute's `commit` argument spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            CommitPath::Single => "single",
            CommitPath::Two => "two",
        }
    }
}

/// The commit path of transactional routes and functions that pick none, on every database:
/// single commit (one commit instead of two; measured in BENCHMARKS.md).
pub const DEFAULT_COMMIT: CommitPath = CommitPath::Single;

/// Default for [`TxOptions::wait`]: how long a duplicate waits for the transaction that holds
/// its key before it gets 409.
pub const DEFAULT_TX_WAIT: Duration = Duration::from_millis(50);
/// Default for [`TxOptions::max_waiters`].
pub const DEFAULT_MAX_WAITERS: usize = 4;

/// A transactional route's settings, resolved from its attribute and the configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TxOptions {
    /// Single or two commits.
    pub commit: CommitPath,
    /// Single commit on PostgreSQL and MySQL: how long a request whose key is held by another
    /// open transaction waits for it (polling, bounded) before it gets 409; if the other
    /// commits meanwhile, the waiter gets the replay. Never applies to the handler's own
    /// statements.
    /// (SQLite waits for its write lock instead: the busy timeout, after the store's queue if
    /// it has one.)
    pub wait: Duration,
    /// At most this many requests per key wait in one process; more get 409 at once, so
    /// duplicates cannot take every pooled connection.
    pub max_waiters: usize,
    /// Single commit on PostgreSQL: read the record before opening a transaction (default
    /// `true`). A replay then costs one read-only statement, as in plain mode; after a read
    /// that found nothing, BEGIN and the claim share one round trip, so a first execution
    /// costs five round trips either way. With `false` a replay costs three statements
    /// (BEGIN, the claim statement, which writes nothing, and ROLLBACK) and a first
    /// execution gains nothing measurable: leave it on. On MySQL, with `true`, a replay is
    /// one read and a first execution five round trips (the read, BEGIN, the lock with the
    /// insert, the complete, COMMIT); with `false` the claim inside the transaction reads
    /// first all the same (an insert over an existing row would wait for its lock), so a
    /// replay costs three. SQLite always reads first (a claim there takes the database's one
    /// write lock).
    pub read_first: bool,
}

#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub(crate) mod commit;
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
mod held;
#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
mod transaction;

#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub use commit::{Halted, TxBegin, TxExecution, TxFinished};
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
#[doc(hidden)]
pub use held::Held;
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
#[doc(hidden)]
pub use transaction::{FinishError, FirstClaim, ReadFirst};
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub use transaction::{Transaction, TxDatabase};
