//! The `Store` trait: what every store (memory, SQLite, PostgreSQL, MySQL, Redis) promises, the records
//! stores keep, the stores themselves and the sweeper that purges them.

pub(crate) mod changes;
pub(crate) mod fence;
pub(crate) mod memory;
pub(crate) mod record;
#[cfg(feature = "redis")]
pub(crate) mod redis;
pub(crate) mod renew;
#[cfg(any(
    feature = "sqlite",
    feature = "postgres",
    feature = "mysql",
    feature = "redis"
))]
pub(crate) mod row;
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub(crate) mod sql;
pub(crate) mod sweeper;

#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use self::redis::{RedisSetupError, RedisStore, RedisStoreBuilder};
pub use changes::{ChangeId, Changes, Watch};
pub use fence::{Lease, LeaseToken};
pub use memory::{MemoryStore, MemoryStoreBuilder};
pub use record::{Record, RecordKey, RecordState, StoredOutcome, StoredResponse, retry_after_secs};
pub use renew::{RenewalTimedOut, wants_fresh_connection};
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
#[cfg_attr(
    docsrs,
    doc(cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql")))
)]
pub use sql::SetupError;
#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub use sql::mysql::{MySqlStore, MySqlStoreBuilder};
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use sql::postgres::{PostgresStore, PostgresStoreBuilder};
#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
pub use sql::sqlite::{DEFAULT_BUSY_TIMEOUT, SqliteStore, SqliteStoreBuilder};
pub use sweeper::Sweeper;

use crate::fingerprint::Fingerprint;
use std::time::Duration;

/// A request to claim a record.
#[derive(Debug, Clone, Copy)]
pub struct ClaimRequest<'a> {
    /// (scope, key).
    pub key: &'a RecordKey,
    /// The request's fingerprint.
    pub fingerprint: &'a Fingerprint,
    /// How long the claimer holds the record before another attempt may take it over.
    pub lease: Duration,
    /// How long the record lives (a floor): a claim after that is a new request.
    pub ttl: Duration,
    /// The most bytes the claim's outcome may hold when stored: the route's response limit
    /// (HTTP `max_response`; a larger body is stored as the "not stored" marker). Stores with
    /// byte budgets (memory, Redis) reserve it against them when they admit the claim and
    /// settle at `complete` (charging what was stored) or `release` (giving it back), so
    /// concurrent claims cannot together store past a budget. `0` reserves nothing.
    pub max_stored: u64,
}

/// What a claim found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimOutcome {
    /// The caller owns the record now and must run the handler, then `complete` or `release`.
    Claimed(Lease),
    /// A finished record with the same fingerprint: replay it, never run the handler.
    Replay(StoredOutcome),
    /// Another attempt with the same fingerprint holds a live lease.
    InProgress {
        /// How long until that lease runs out (store clock).
        retry_after: Duration,
    },
    /// The record belongs to a request with a different fingerprint.
    Mismatch {
        /// Whether that other request is still in progress.
        in_progress: bool,
    },
}

/// Errors from stores.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The caller's lease token no longer matches the record: another attempt took it over,
    /// or the record is gone. Nothing was written.
    #[error("stale lease: the record is no longer held by this attempt")]
    StaleLease,
    /// The store is full (memory store: `max_entries` live records).
    #[error("the store is at capacity ({max_entries} records)")]
    Capacity {
        /// The configured bound.
        max_entries: usize,
    },
    /// One scope holds as many records as the store allows a scope (memory store:
    /// `max_per_scope` live records), so this caller's new keys are refused while other
    /// callers' go on.
    #[error("this scope holds as many records as the store allows one scope ({max_per_scope})")]
    ScopeCapacity {
        /// The configured bound.
        max_per_scope: usize,
    },
    /// The store holds as many bytes as it allows (memory store: `max_bytes`, an estimate of
    /// what its records hold in memory).
    #[error("the store holds as many bytes as it allows ({max_bytes})")]
    ByteCapacity {
        /// The configured budget, in bytes.
        max_bytes: u64,
    },
    /// One scope holds as many bytes as the store allows one scope (memory store:
    /// `max_bytes_per_scope`), so this caller's new keys are refused while other callers' go
    /// on.
    #[error("this scope holds as many bytes as the store allows one scope ({max_bytes_per_scope})")]
    ScopeByteCapacity {
        /// The configured budget, in bytes.
        max_bytes_per_scope: u64,
    },
    /// The store cannot be reached or failed (connection loss, pool timeout, busy database).
    #[error("store unavailable: {0}")]
    Unavailable(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The store holds data this version cannot read.
    #[error("corrupt record: {0}")]
    Corrupt(String),
}

impl StoreError {
    /// Wraps any error as [`StoreError::Unavailable`].
    pub fn unavailable(e: impl std::error::Error + Send + Sync + 'static) -> Self {
        StoreError::Unavailable(Box::new(e))
    }
}

/// What [`Store::delete`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Deleted {
    /// The record was deleted; this is what it held.
    Deleted(Record),
    /// The record is in progress and `force` was not given: nothing was deleted.
    InProgress(Record),
    /// There is no record for the key.
    Absent,
}

/// Storage for idempotency records.
///
/// # Promises (every implementation keeps them)
/// - [`claim`](Store::claim) is **one atomic operation**: of any number of concurrent claims
///   of one absent key, exactly one returns [`ClaimOutcome::Claimed`]; the others see that
///   record. It takes over a record whose ttl has passed (any fingerprint), and an
///   `in_progress` record whose lease has run out **with the same fingerprint**, issuing a new
///   token. It never checks-then-inserts across two operations; a replay writes nothing.
/// - [`complete`](Store::complete), [`release`](Store::release) and
///   [`extend`](Store::extend) are **fenced**: they change the record only if it still carries
///   the caller's token *and* is in progress, atomically; otherwise they return
///   [`StoreError::StaleLease`] and change nothing.
/// - Time (leases, expiry) comes from the store's clock (the database's in SQL stores), so
///   servers with skewed clocks agree.
/// - An expired record counts as absent on every read, swept or not.
#[async_trait::async_trait]
pub trait Store: Send + Sync + 'static {
    /// Claims `req.key`, or reports the record that holds it (see the trait's promises).
    ///
    /// # Errors
    /// [`StoreError::Unavailable`], [`StoreError::Capacity`], [`StoreError::ScopeCapacity`],
    /// [`StoreError::ByteCapacity`], [`StoreError::ScopeByteCapacity`],
    /// [`StoreError::Corrupt`].
    async fn claim(&self, req: ClaimRequest<'_>) -> Result<ClaimOutcome, StoreError>;

    /// [`claim`](Store::claim), also saying, for a [`ClaimOutcome::Replay`], how long the
    /// record still lives (its expiry less the store's now, as the claim read it), when its
    /// fingerprint is of the request's version (one of another version matched by key alone,
    /// and is reported as `None`). An engine
    /// with a replay cache ([`EngineBuilder::replay_cache`](crate::engine::EngineBuilder::replay_cache))
    /// calls this, and keeps a replayed record only when the store says how long it lives, so a
    /// kept copy never outlives it. The default says nothing (`None`: the record is replayed
    /// but not kept); every store of this crate says. Wrappers that forward to another store
    /// should forward this too.
    ///
    /// # Errors
    /// As [`claim`](Store::claim).
    async fn claim_with_expiry(
        &self,
        req: ClaimRequest<'_>,
    ) -> Result<(ClaimOutcome, Option<Duration>), StoreError> {
        Ok((self.claim(req).await?, None))
    }

    /// Finishes the attempt holding `token`: the record becomes `done` with `outcome`, and
    /// expires no sooner than `ttl` after now. (A claim sets the expiry to now + lease + ttl,
    /// so a handler that finishes within its lease leaves it unchanged: the ttl is a floor.)
    ///
    /// # Errors
    /// [`StoreError::StaleLease`] when `token` no longer holds the record.
    async fn complete(
        &self,
        key: &RecordKey,
        token: LeaseToken,
        outcome: &StoredOutcome,
        ttl: Duration,
    ) -> Result<(), StoreError>;

    /// Deletes the record held by `token`, so the next request runs the handler again.
    ///
    /// # Errors
    /// [`StoreError::StaleLease`] when `token` no longer holds the record.
    async fn release(&self, key: &RecordKey, token: LeaseToken) -> Result<(), StoreError>;

    /// Moves the lease of `token` to `lease` after now (heartbeat); returns the new end.
    ///
    /// # Errors
    /// [`StoreError::StaleLease`] when `token` no longer holds the record.
    async fn extend(
        &self,
        key: &RecordKey,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<std::time::SystemTime, StoreError>;

    /// What an execution's heartbeat calls: [`extend`](Store::extend), bounded so that one
    /// silent connection cannot let a live lease run out. The default gives a first attempt
    /// an eighth of the lease and, if it had no answer or failed as unavailable, a second one
    /// within seven sixteenths of the lease in all ([`RenewalTimedOut`] past that).
    ///
    /// An implementation that keeps connections should run the second attempt on another one:
    /// [`wants_fresh_connection`] is true inside it (the SQL stores then open a connection for
    /// it, outside their pools, and close the one the abandoned attempt held). Override this
    /// only to bound renewals another way (the Redis store does, replacing its connection);
    /// wrappers that forward to another store should forward this too.
    ///
    /// # Errors
    /// As [`extend`](Store::extend), and [`StoreError::Unavailable`] when neither attempt
    /// answered in time.
    async fn renew(
        &self,
        key: &RecordKey,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<std::time::SystemTime, StoreError> {
        renew::bounded(self, key, token, lease).await
    }

    /// Deletes at most `batch` expired records; returns how many it deleted.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`].
    async fn purge_expired(&self, batch: usize) -> Result<u64, StoreError>;

    /// Reads a live record, for inspection and tests (not on the request path).
    ///
    /// # Errors
    /// [`StoreError::Unavailable`], [`StoreError::Corrupt`].
    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError>;

    /// Deletes `key`'s record (for support staff: a record to forget, or one to let a client
    /// run again), expired ones included, and returns it as it was. The check of its state and
    /// the delete are one atomic operation: an in-progress record is never deleted without
    /// `force`, whatever runs concurrently. (A single-commit claim still inside its open
    /// transaction is invisible, so it is [`Deleted::Absent`].) An **in-progress** record
    /// is deleted only with `force`: deleting it lets a retry run the handler while the first
    /// execution may still be running (that execution's complete is then refused by the
    /// fence, but its side effects are not undone).
    ///
    /// # Errors
    /// [`StoreError::Unavailable`], [`StoreError::Corrupt`].
    async fn delete(&self, key: &RecordKey, force: bool) -> Result<Deleted, StoreError>;

    /// The store itself, when it can run transactional executions (the SQL stores, see
    /// [`TxDatabase`](crate::tx::TxDatabase)); `None` (the default) for every other store.
    /// Wrappers that forward to such a store should forward this too.
    fn transactional(&self) -> Option<&dyn std::any::Any> {
        None
    }

    /// Whether the store deletes expired records by itself (Redis, by key expiry): then
    /// [`purge_expired`](Store::purge_expired) deletes nothing and the adapters' automatic
    /// sweeper does not start. `false` (the default) for every other store. Wrappers that
    /// forward to such a store should forward this too.
    fn expires_by_itself(&self) -> bool {
        false
    }

    /// The store's change notifications ([`Changes`]), which wake requests waiting for a
    /// running duplicate's answer (a route's `wait`). `None` (the default): the engine keeps a
    /// hub of its own, so waiters in its process still wake when it completes or releases, and
    /// poll at most every second for the rest. Wrappers that forward to a store should forward
    /// this too.
    fn changes(&self) -> Option<&Changes> {
        None
    }
}

#[async_trait::async_trait]
impl<S: Store + ?Sized> Store for std::sync::Arc<S> {
    async fn claim(&self, req: ClaimRequest<'_>) -> Result<ClaimOutcome, StoreError> {
        (**self).claim(req).await
    }
    async fn claim_with_expiry(
        &self,
        req: ClaimRequest<'_>,
    ) -> Result<(ClaimOutcome, Option<Duration>), StoreError> {
        (**self).claim_with_expiry(req).await
    }
    async fn complete(
        &self,
        key: &RecordKey,
        token: LeaseToken,
        outcome: &StoredOutcome,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        (**self).complete(key, token, outcome, ttl).await
    }
    async fn release(&self, key: &RecordKey, token: LeaseToken) -> Result<(), StoreError> {
        (**self).release(key, token).await
    }
    async fn extend(
        &self,
        key: &RecordKey,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<std::time::SystemTime, StoreError> {
        (**self).extend(key, token, lease).await
    }
    async fn renew(
        &self,
        key: &RecordKey,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<std::time::SystemTime, StoreError> {
        (**self).renew(key, token, lease).await
    }
    async fn purge_expired(&self, batch: usize) -> Result<u64, StoreError> {
        (**self).purge_expired(batch).await
    }
    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        (**self).get(key).await
    }
    async fn delete(&self, key: &RecordKey, force: bool) -> Result<Deleted, StoreError> {
        (**self).delete(key, force).await
    }
    fn transactional(&self) -> Option<&dyn std::any::Any> {
        (**self).transactional()
    }
    fn expires_by_itself(&self) -> bool {
        (**self).expires_by_itself()
    }
    fn changes(&self) -> Option<&Changes> {
        (**self).changes()
    }
}
