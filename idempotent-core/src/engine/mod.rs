//! The engine: claim → execute → complete/release → replay, and the executions it owns.
//!
//! - this file: the settings ([`Policy`], the duration bounds) and the [`Engine`] itself;
//! - `claim.rs`: [`Engine::begin`], the one entry, and what it answers ([`Begin`]);
//! - `lease.rs`: one claimed [`Execution`]: its lease, heartbeat and fenced writes;
//! - `flight.rs`: what [`Engine::drain`] counts, and the automatic sweeper it stops;
//! - `detached.rs`: `Detached`, the future that outlives its caller (the adapters' tool).

pub(crate) mod cache;
mod claim;
pub(crate) mod detached;
mod flight;
mod lease;
mod wait;

pub use cache::{
    DEFAULT_CACHE_MAX_AGE, DEFAULT_CACHE_MAX_BYTES, DEFAULT_CACHE_MAX_BYTES_PER_SCOPE, ReplayCache,
};
pub use claim::{Begin, Unprotected};
pub(crate) use flight::{AutoSweep, InFlight};
#[cfg_attr(
    not(any(feature = "sqlite", feature = "postgres", feature = "mysql")),
    allow(unused_imports)
)]
pub(crate) use lease::NoAnswer;
pub(crate) use lease::Progress;
#[cfg_attr(
    not(any(feature = "postgres", feature = "mysql")),
    allow(unused_imports)
)]
pub(crate) use lease::write_bound;
pub use lease::{Execution, PanicPayload};
pub(crate) use wait::Gone;
pub use wait::{DEFAULT_MAX_WAITING, DEFAULT_MAX_WAITING_PER_KEY};

use crate::derive::DeriveSecret;
use crate::fingerprint::Fingerprint;
use crate::key::{IdempotencyKey, KeyError};
use crate::observe::{self, Settled};
use crate::scope::Scope;
use crate::store::record::RecordKey;
use crate::store::{Store, StoreError};
use flight::Flight;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Default ttl: how long a finished response is replayed.
pub const DEFAULT_TTL: Duration = Duration::from_secs(24 * 3600);
/// Default lease: how long a crashed attempt blocks retries.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);
/// The most a record's response may hold by default: 1 MiB (the HTTP routes' default
/// [`max_response`](crate::http::DEFAULT_MAX_RESPONSE) is this value).
pub(crate) const DEFAULT_MAX_STORED: usize = 1 << 20;
/// Default interval of the engine's automatic sweeper ([`EngineBuilder::sweep_every`]): 60 s.
pub const DEFAULT_SWEEP_EVERY: Duration = Duration::from_secs(60);

/// Longest ttl or lease accepted: 365 days (the attribute enforces the same bounds at compile
/// time).
pub const MAX_DURATION: Duration = Duration::from_secs(365 * 86_400);
/// Shortest ttl or lease accepted: 100 ms. Stores keep time in milliseconds and a heartbeat
/// extends a lease every half lease; a lease much shorter than that could lapse under a
/// running handler and let a retry take over.
pub const MIN_DURATION: Duration = Duration::from_millis(100);

/// Why a configuration or a route's arguments were refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A duration is shorter than [`MIN_DURATION`].
    #[error("`{what}` of {value:?} is shorter than the minimum of 100ms")]
    TooShort {
        /// Which setting.
        what: &'static str,
        /// Its value.
        value: Duration,
    },
    /// A duration is longer than [`MAX_DURATION`].
    #[error("`{what}` of {value:?} is longer than the maximum of 365 days")]
    TooLong {
        /// Which setting.
        what: &'static str,
        /// Its value.
        value: Duration,
    },
    /// The ttl is shorter than the lease.
    #[error(
        "`ttl` ({ttl:?}) is shorter than `lease` ({lease:?}); a finished response must outlive the lease that protects its first attempt"
    )]
    TtlShorterThanLease {
        /// The ttl.
        ttl: Duration,
        /// The lease.
        lease: Duration,
    },
    /// The wait is longer than the lease.
    #[error(
        "`wait` ({wait:?}) is longer than `lease` ({lease:?}); a duplicate waits at most as long as the lease of the attempt it waits for"
    )]
    WaitLongerThanLease {
        /// The wait.
        wait: Duration,
        /// The lease.
        lease: Duration,
    },
    /// A size limit is zero.
    #[error("`{what}` must be at least 1 byte")]
    ZeroSize {
        /// Which setting.
        what: &'static str,
    },
}

/// The rules for a ttl and lease pair, wherever they come from: each within
/// [`MIN_DURATION`]..=[`MAX_DURATION`], and the ttl at least the lease.
pub(crate) fn check_ttl_and_lease(ttl: Duration, lease: Duration) -> Result<(), ConfigError> {
    check_duration("ttl", ttl)?;
    check_duration("lease", lease)?;
    if ttl < lease {
        return Err(ConfigError::TtlShorterThanLease { ttl, lease });
    }
    Ok(())
}

/// A wait longer than the lease is refused: a waiter outliving the lease of the attempt it
/// waits for would take the record over (and run the handler) while its own client waits, which
/// a retry after the lease does too, with nothing gained by waiting.
pub(crate) fn check_wait(wait: Duration, lease: Duration) -> Result<(), ConfigError> {
    if wait > lease {
        return Err(ConfigError::WaitLongerThanLease { wait, lease });
    }
    Ok(())
}

pub(crate) fn check_duration(what: &'static str, value: Duration) -> Result<(), ConfigError> {
    if value < MIN_DURATION {
        Err(ConfigError::TooShort { what, value })
    } else if value > MAX_DURATION {
        Err(ConfigError::TooLong { what, value })
    } else {
        Ok(())
    }
}

/// Whether a route requires an `Idempotency-Key`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KeyRequirement {
    /// A request without a key is refused ([`Begin::KeyRejected`] with [`KeyError::Missing`]).
    #[default]
    Required,
    /// A request without a key runs the handler unprotected
    /// ([`Begin::Unprotected`] with [`Unprotected::NoKey`]).
    Optional,
}

/// Per-route settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// How long a finished response is replayed (a floor).
    pub ttl: Duration,
    /// How long an attempt holds the record before a retry may take over; heartbeats extend
    /// it while the handler runs.
    pub lease: Duration,
    /// Store 5xx outcomes too (Stripe style) instead of releasing the key.
    pub store_server_errors: bool,
    /// Whether a key is required.
    pub key: KeyRequirement,
    /// Run the handler unprotected when the store fails, instead of refusing the request.
    /// Never for [`StoreError::Corrupt`]: a record the store cannot read exists, so that
    /// request is refused ([`Begin::StoreUnavailable`]) whatever this says.
    pub fail_open: bool,
    /// The route's name for logs (the handler's name under `#[idempotent]`; low cardinality,
    /// never a concrete path).
    pub route: &'static str,
    /// The most bytes a stored outcome of this route holds (HTTP: the route's `max_response`),
    /// reserved by stores with byte budgets when they admit a claim
    /// ([`ClaimRequest::max_stored`](crate::store::ClaimRequest::max_stored)). Default
    /// [`DEFAULT_MAX_RESPONSE`](crate::http::DEFAULT_MAX_RESPONSE) (1 MiB).
    pub max_stored: usize,
    /// How long a request that finds its record in progress waits for that attempt's answer
    /// (then replays it, or runs the handler if the attempt released the key) before it is
    /// answered "in progress" (HTTP 409). Default zero: answered at once. At most the lease
    /// ([`Policy::check`]). See [`Engine::begin`].
    pub wait: Duration,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            ttl: DEFAULT_TTL,
            lease: DEFAULT_LEASE,
            store_server_errors: false,
            key: KeyRequirement::Required,
            fail_open: false,
            route: "",
            max_stored: DEFAULT_MAX_STORED,
            wait: Duration::ZERO,
        }
    }
}

impl Policy {
    /// Checks the ttl and lease: each from [`MIN_DURATION`] to [`MAX_DURATION`], the ttl at
    /// least the lease, and the wait at most the lease. [`Engine::begin`] refuses a policy
    /// that fails this ([`Begin::Misconfigured`]) rather than run under a lease that cannot
    /// hold.
    ///
    /// # Errors
    /// The first rule broken.
    pub fn check(&self) -> Result<(), ConfigError> {
        check_ttl_and_lease(self.ttl, self.lease)?;
        check_wait(self.wait, self.lease)
    }

    /// Whether an outcome with `status` is stored (else the key is released).
    ///
    /// 2xx, 3xx and 4xx are stored except 408, 409, 425 and 429 (they mean "try again");
    /// 5xx only with [`Policy::store_server_errors`]; anything else (1xx, invalid) is released.
    ///
    /// ```
    /// use idempotent_core::engine::Policy;
    /// let p = Policy::default();
    /// assert!(p.stores(201) && p.stores(404) && p.stores(302));
    /// assert!(!p.stores(409) && !p.stores(429) && !p.stores(500));
    /// ```
    pub fn stores(&self, status: u16) -> bool {
        match status {
            408 | 409 | 425 | 429 => false,
            200..=499 => true,
            500..=599 => self.store_server_errors,
            _ => false,
        }
    }
}

/// One request, as the engine sees it.
#[derive(Debug, Clone)]
pub struct ExecuteRequest {
    /// The caller.
    pub scope: Scope,
    /// The parsed `Idempotency-Key` (or why it could not be parsed).
    pub key: Result<IdempotencyKey, KeyError>,
    /// The request's fingerprint.
    pub fingerprint: Fingerprint,
}

/// What became of the record after the handler ran.
#[derive(Debug)]
#[non_exhaustive]
pub enum Recorded {
    /// The outcome is stored and will be replayed.
    Stored,
    /// The outcome was not storable (5xx, 408/409/425/429, a panic, a failed body): the key
    /// was released, so a retry runs again.
    Released,
    /// Writing the record failed even after bounded retries (lost lease, store error). The
    /// record stays in progress until its lease runs out: a retry meanwhile gets "in progress",
    /// and after that it takes over and runs the handler again (the documented limit of plain
    /// mode). Logged with `tracing` at error level.
    Failed(StoreError),
}

/// What [`crate::observe`] reports for a record.
impl From<&Recorded> for Settled {
    fn from(recorded: &Recorded) -> Self {
        match recorded {
            Recorded::Stored => Settled::Stored,
            Recorded::Released => Settled::Released,
            Recorded::Failed(StoreError::StaleLease) => Settled::FenceRefused,
            Recorded::Failed(_) => Settled::Failed,
        }
    }
}

/// Runs handlers at most once per (scope, key), over any [`Store`], and owns the executions
/// it starts.
///
/// [`Engine::begin`] is its one entry: it claims the request's record and says whether to run
/// the work (under the [`Execution`] it hands back) or how to answer without running it.
///
/// ```
/// use idempotent_core::engine::{Begin, ExecuteRequest, Policy};
/// use idempotent_core::fingerprint::{Fingerprint, FingerprintInput};
/// use idempotent_core::store::StoredResponse;
/// use idempotent_core::{Engine, IdempotencyKey, MemoryStore, Scope};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let engine = Engine::new(MemoryStore::new());
/// let request = || ExecuteRequest {
///     scope: Scope::new("acct_1").unwrap(),
///     key: IdempotencyKey::parse(b"k1"),
///     fingerprint: Fingerprint::compute(&FingerprintInput {
///         method: "POST", path: "/charges", query: None, content_type: None, body: b"",
///     }),
/// };
/// let policy = Policy::default();
/// // The first request claims the record, runs the work and stores its outcome...
/// let Begin::Claimed(mut execution) = engine.begin(request(), &policy).await else {
///     panic!("the first request claims")
/// };
/// let response = execution.run(async { StoredResponse::new(201, "ch_1") }).await.unwrap();
/// execution.finish(response.into()).await;
/// // ...and a retry is answered with that outcome, without running the work again.
/// assert!(matches!(engine.begin(request(), &policy).await, Begin::Replay(_)));
/// # }
/// ```
///
/// # Life cycle
/// Every claimed execution is counted until it is finished (its outcome stored or the key
/// released). [`Engine::drain`] stops new executions and waits, bounded, for the running ones:
/// call it after your server stops accepting connections, so work that lost its client still
/// gets stored before the process exits.
#[derive(Clone)]
pub struct Engine {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) store: Arc<dyn Store>,
    /// The lease of routes and functions that set none ([`EngineBuilder::lease`]).
    lease: Duration,
    /// The secret of derived keys ([`EngineBuilder::derive_secret`]).
    derive_secret: Option<DeriveSecret>,
    flight: Flight,
    /// The key of the record hashes in spans ([`crate::observe`]).
    pub(crate) log_key: observe::LogKey,
    /// The sweeper an adapter's configuration starts with the first request.
    pub(crate) auto_sweep: AutoSweep,
    /// Requests waiting for another transaction on their key, per key (transactional mode).
    #[cfg_attr(
        not(any(feature = "sqlite", feature = "postgres", feature = "mysql")),
        allow(dead_code)
    )]
    pub(crate) waiters: std::sync::Mutex<std::collections::HashMap<RecordKey, usize>>,
    /// The hub of waiters whose store has none ([`Store::changes`]).
    local_changes: crate::store::Changes,
    /// Requests waiting for a running duplicate's answer ([`Policy::wait`]), and the bounds.
    waiting: std::sync::atomic::AtomicUsize,
    max_waiting: usize,
    max_waiting_per_key: usize,
    /// The local replay cache ([`EngineBuilder::replay_cache`]).
    pub(crate) cache: Option<cache::Cache>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("lease", &self.inner.lease)
            .field("running", &self.running())
            .finish_non_exhaustive()
    }
}

/// Builds an [`Engine`] with its engine-wide settings, set once here: the default lease and
/// the secret of derived keys (which also keys the record hashes in logs, so every instance
/// sharing the secret logs the same hash for one record). Start it with [`Engine::builder`].
#[derive(Clone)]
#[must_use]
pub struct EngineBuilder {
    store: Arc<dyn Store>,
    lease: Duration,
    derive_secret: Option<DeriveSecret>,
    sweep_every: Option<Duration>,
    max_waiting: usize,
    max_waiting_per_key: usize,
    replay_cache: Option<ReplayCache>,
}

impl std::fmt::Debug for EngineBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineBuilder")
            .field("lease", &self.lease)
            .field("derive_secret", &self.derive_secret.is_some())
            .field("sweep_every", &self.sweep_every)
            .field("max_waiting", &self.max_waiting)
            .field("max_waiting_per_key", &self.max_waiting_per_key)
            .field("replay_cache", &self.replay_cache)
            .finish_non_exhaustive()
    }
}

impl EngineBuilder {
    /// The lease (how long a crashed attempt blocks retries; heartbeat-extended while the work
    /// runs) of the routes and functions that set none: 100 ms to 365 days, default 30 s. A
    /// ttl must be at least the lease: an HTTP configuration built over this engine
    /// ([`crate::http::ConfigBuilder::build`]) refuses a default ttl shorter than it.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// The secret that downstream keys ([`Idempotent::derive`](crate::Idempotent::derive))
    /// are derived under, required by every handler or function that takes an
    /// [`Idempotent`](crate::Idempotent) parameter. No default: see [`DeriveSecret`] for why,
    /// and for rotation.
    pub fn derive_secret(mut self, secret: DeriveSecret) -> Self {
        self.derive_secret = Some(secret);
        self
    }

    /// How often the engine's sweeper deletes expired records (default every 60 s,
    /// [`DEFAULT_SWEEP_EVERY`]; 100 ms to 365 days). The engine starts it with its first
    /// request (or call), on that request's tokio runtime, once however many workers share the
    /// engine (Actix builds its `App` once per worker: still one sweeper), and
    /// [`Engine::drain`] stops it. Records past their ttl count as absent whether or not they
    /// were swept; the sweeper only frees the space. Deletes in batches of 1,000, at most 100
    /// batches per round. A store that deletes expired records itself (Redis) gets none.
    pub fn sweep_every(mut self, interval: Duration) -> Self {
        self.sweep_every = Some(interval);
        self
    }

    /// At most this many requests wait for a running duplicate's answer ([`Policy::wait`]) in
    /// this engine at once (default 1,024, [`DEFAULT_MAX_WAITING`]); more are answered "in
    /// progress" at once. A waiter holds no store connection, only a task and a few hundred
    /// bytes. 0: none waits.
    pub fn max_waiting(mut self, n: usize) -> Self {
        self.max_waiting = n;
        self
    }

    /// At most this many requests wait on one record in this engine (default 32,
    /// [`DEFAULT_MAX_WAITING_PER_KEY`]); more are answered "in progress" at once.
    pub fn max_waiting_per_key(mut self, n: usize) -> Self {
        self.max_waiting_per_key = n;
        self
    }

    /// Keeps completed records in a local replay cache ([`ReplayCache`]; off by default): a
    /// retry of a request this engine completed is then answered from process memory, with no
    /// store call (and, over HTTP, before the handler's body extractors run). An entry lives
    /// until its record's expiry or the cache's [`max_age`](ReplayCache::max_age), whichever
    /// comes first: `max_age` bounds how long this instance replays a record deleted
    /// (`idempotent-admin`) or rewritten in the store behind it. Bounded in bytes, in all and
    /// per scope. Worth it on a remote store (PostgreSQL, MySQL, Redis); the memory store is a
    /// cache already.
    pub fn replay_cache(mut self, cache: ReplayCache) -> Self {
        self.replay_cache = Some(cache);
        self
    }

    /// No automatic sweeper (run [`Sweeper`](crate::store::Sweeper) yourself, or delete expired
    /// records another way).
    pub fn no_sweeper(mut self) -> Self {
        self.sweep_every = None;
        self
    }

    /// The engine.
    ///
    /// # Errors
    /// [`ConfigError`] for a lease or sweep interval out of bounds, or replay cache settings
    /// out of bounds (a zero byte budget, a `max_age` under 1 ms or over 365 days).
    pub fn build(self) -> Result<Engine, ConfigError> {
        check_duration("lease", self.lease)?;
        if let Some(cache) = &self.replay_cache {
            cache.check()?;
        }
        if let Some(every) = self.sweep_every {
            check_duration("sweep_every", every)?;
        }
        Ok(self.engine())
    }

    /// The engine, its settings already checked.
    fn engine(self) -> Engine {
        let log_key = match &self.derive_secret {
            Some(secret) => observe::LogKey::from_secret(secret),
            None => observe::LogKey::new(),
        };
        let auto_sweep = AutoSweep::default();
        auto_sweep.configure(self.sweep_every);
        Engine {
            inner: Arc::new(Inner {
                store: self.store,
                lease: self.lease,
                derive_secret: self.derive_secret,
                flight: Flight::default(),
                log_key,
                auto_sweep,
                waiters: std::sync::Mutex::default(),
                local_changes: crate::store::Changes::in_process(Duration::from_secs(1)),
                waiting: std::sync::atomic::AtomicUsize::new(0),
                max_waiting: self.max_waiting,
                max_waiting_per_key: self.max_waiting_per_key,
                cache: self.replay_cache.map(cache::Cache::new),
            }),
        }
    }
}

/// What [`Engine::drain`] saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Drained {
    /// Executions still running when the bound passed (0 when all finished). Their records
    /// stay in progress until their leases end; a retry after that runs them again.
    pub still_running: usize,
    /// Executions this engine has seen dropped before they finished, over its whole life (a
    /// runtime shut down under them, or a caller dropped a claimed [`Execution`] without finishing it): their
    /// records stay in progress until their leases end. Nonzero at shutdown usually means the
    /// server stopped its runtimes before draining.
    pub dropped_unfinished: usize,
}

impl Engine {
    /// An engine over `store` with the defaults: lease 30 s, no derive secret.
    pub fn new(store: impl Store) -> Self {
        Self::from_arc(Arc::new(store))
    }

    /// An engine over a shared store, with the defaults.
    pub fn from_arc(store: Arc<dyn Store>) -> Self {
        Self::builder_from_arc(store).engine()
    }

    /// Starts an engine over `store` whose engine-wide settings you set: the default lease and
    /// the secret of derived keys. HTTP limits are the adapter's configuration
    /// ([`crate::http::ConfigBuilder`]); function mode's are [`crate::call::Calls`]'.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idempotent_core::{DeriveSecret, Engine, MemoryStore};
    ///
    /// let engine = Engine::builder(MemoryStore::new())
    ///     .lease(Duration::from_secs(10))
    ///     .derive_secret(DeriveSecret::new("a long random string from the secret manager")?)
    ///     .build()?;
    /// assert_eq!(engine.lease(), Duration::from_secs(10));
    /// assert!(engine.derive_secret().is_some());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn builder(store: impl Store) -> EngineBuilder {
        Self::builder_from_arc(Arc::new(store))
    }

    /// [`Engine::builder`] over a shared store.
    pub fn builder_from_arc(store: Arc<dyn Store>) -> EngineBuilder {
        EngineBuilder {
            store,
            lease: DEFAULT_LEASE,
            derive_secret: None,
            sweep_every: Some(DEFAULT_SWEEP_EVERY),
            max_waiting: DEFAULT_MAX_WAITING,
            max_waiting_per_key: DEFAULT_MAX_WAITING_PER_KEY,
            replay_cache: None,
        }
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.inner.store
    }

    /// The lease of the routes and functions that set none ([`EngineBuilder::lease`]).
    pub fn lease(&self) -> Duration {
        self.inner.lease
    }

    /// The replay cache's settings, when it has one ([`EngineBuilder::replay_cache`]).
    pub fn replay_cache(&self) -> Option<ReplayCache> {
        self.inner.cache.as_ref().map(cache::Cache::settings)
    }

    /// The bytes the replay cache holds now, in all or (`Some(scope)`) for one scope, as it
    /// estimates them, after running its pending evictions and expiries; `None` without a
    /// cache. For tests and diagnostics (it takes the cache's maintenance lock).
    pub fn replay_cache_bytes(&self, scope: Option<&Scope>) -> Option<u64> {
        let cache = self.inner.cache.as_ref()?;
        cache.settle();
        Some(match scope {
            Some(scope) => cache.scope_bytes(scope),
            None => cache.bytes(),
        })
    }

    /// The secret downstream keys are derived under ([`EngineBuilder::derive_secret`]).
    pub fn derive_secret(&self) -> Option<&DeriveSecret> {
        self.inner.derive_secret.as_ref()
    }

    /// The ttl of routes and functions that set none: 24 h ([`DEFAULT_TTL`]), or the engine's
    /// lease when that is longer (a ttl under the lease would be refused).
    pub(crate) fn default_ttl(&self) -> Duration {
        DEFAULT_TTL.max(self.lease())
    }

    /// Requests waiting for a running duplicate's answer now ([`Policy::wait`]).
    pub fn waiting(&self) -> usize {
        self.inner.waiting.load(Ordering::SeqCst)
    }

    /// Executions claimed (or being claimed) and not yet finished.
    pub fn running(&self) -> usize {
        self.inner.flight.running.load(Ordering::SeqCst)
    }

    /// Whether the engine's sweeper ([`EngineBuilder::sweep_every`]) is running: from the first
    /// request until [`Engine::drain`].
    pub fn sweeper_running(&self) -> bool {
        self.inner.auto_sweep.is_running()
    }

    /// Whether [`Engine::drain`] has been called.
    pub fn is_draining(&self) -> bool {
        self.inner.flight.draining.load(Ordering::SeqCst)
    }

    /// Stops new executions ([`Begin::Draining`] from then on) and waits until the running
    /// ones have finished, or `timeout` has passed. Executions still running then are logged
    /// (`tracing`, warn level); their records stay in progress until their leases end.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use std::time::Duration;
    /// let engine = idempotent_core::Engine::new(idempotent_core::MemoryStore::new());
    /// let drained = engine.drain(Duration::from_secs(10)).await;
    /// assert_eq!(drained.still_running, 0);
    /// # }
    /// ```
    pub async fn drain(&self, timeout: Duration) -> Drained {
        let flight = &self.inner.flight;
        flight.draining.store(true, Ordering::SeqCst);
        // The automatic sweeper stops with the engine.
        self.inner.auto_sweep.stop().await;
        let all_done = async {
            loop {
                let idle = flight.idle.notified();
                if flight.running.load(Ordering::SeqCst) == 0 {
                    return;
                }
                idle.await;
            }
        };
        let _ = tokio::time::timeout(timeout, all_done).await;
        let still_running = flight.running.load(Ordering::SeqCst);
        if still_running > 0 {
            tracing::warn!(
                still_running,
                ?timeout,
                "idempotency: executions still running after the drain timeout; their records stay in progress until their leases end"
            );
        }
        let dropped_unfinished = flight.dropped.load(Ordering::SeqCst);
        if dropped_unfinished > 0 {
            tracing::warn!(
                dropped_unfinished,
                "idempotency: executions were dropped before they finished; their records stay in progress until their leases end"
            );
        }
        Drained {
            still_running,
            dropped_unfinished,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fingerprint::FingerprintInput;
    use crate::store::memory::MemoryStore;
    use crate::store::record::{Record, RecordState, StoredResponse};

    fn request(key: &str) -> ExecuteRequest {
        ExecuteRequest {
            scope: Scope::new("acct").expect("scope"),
            key: IdempotencyKey::parse(key.as_bytes()),
            fingerprint: Fingerprint::compute(&FingerprintInput {
                method: "POST",
                path: "/t",
                query: None,
                content_type: None,
                body: b"",
            }),
        }
    }

    /// Point 10 of the exactly-once issue: the heartbeat task cannot outlive its execution.
    /// Dropping a running execution after its heartbeat started must stop extending the lease,
    /// so the key is not held "in progress" for the life of the process.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn heartbeat_stops_when_the_execution_is_dropped() {
        let store = MemoryStore::new();
        let engine = Engine::new(store.clone());
        let policy = Policy {
            lease: Duration::from_millis(200),
            ..Policy::default()
        };
        let Begin::Claimed(mut execution) = engine.begin(request("hb"), &policy).await else {
            panic!("not claimed")
        };
        // Run past half the lease, so the heartbeat task has started, then drop everything.
        let _ = tokio::time::timeout(
            Duration::from_millis(350),
            execution.run(std::future::pending::<()>()),
        )
        .await;
        let key = execution.key().clone();
        let lease_end = |r: Option<Record>| match r.map(|r| r.state) {
            Some(RecordState::InProgress { locked_until, .. }) => locked_until,
            other => panic!("{other:?}"),
        };
        let extended = lease_end(store.get(&key).await.expect("get"));
        drop(execution);
        assert_eq!(engine.running(), 0);
        tokio::time::sleep(Duration::from_millis(450)).await;
        // No extension after the drop, and a retry takes the record over.
        assert_eq!(lease_end(store.get(&key).await.expect("get")), extended);
        match engine.begin(request("hb"), &policy).await {
            Begin::Claimed(e) => drop(e),
            other => panic!("expected a take-over, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn drain_waits_for_running_executions_and_refuses_new_ones() {
        let engine = Engine::new(MemoryStore::new());
        let policy = Policy::default();
        let Begin::Claimed(execution) = engine.begin(request("d1"), &policy).await else {
            panic!("not claimed")
        };
        let finisher = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            execution
                .finish(StoredResponse::new(201, "ok").into())
                .await
        });
        let drained = engine.drain(Duration::from_secs(5)).await;
        assert_eq!(drained.still_running, 0);
        assert!(matches!(finisher.await.expect("join"), Recorded::Stored));
        assert!(matches!(
            engine.begin(request("d2"), &policy).await,
            Begin::Draining
        ));
        // A bounded drain reports what it left behind.
        let engine = Engine::new(MemoryStore::new());
        let Begin::Claimed(stuck) = engine.begin(request("d3"), &policy).await else {
            panic!("not claimed")
        };
        let drained = engine.drain(Duration::from_millis(50)).await;
        assert_eq!(drained.still_running, 1);
        assert_eq!(drained.dropped_unfinished, 0);
        drop(stuck);
        assert_eq!(engine.running(), 0);
        // A dropped, unfinished execution is reported, not mistaken for a clean drain.
        let drained = engine.drain(Duration::from_millis(50)).await;
        assert_eq!((drained.still_running, drained.dropped_unfinished), (0, 1));
    }
}
