//! The application's settings, built and checked once.

use super::{DEFAULT_MAX_REQUEST, DEFAULT_MAX_RESPONSE, DEFAULT_REQUEST_BODY_TIMEOUT};
use crate::engine::{
    ConfigError, DEFAULT_TTL, Engine, MAX_DURATION, check_duration, check_ttl_and_lease,
};
use crate::tx::{CommitPath, DEFAULT_MAX_WAITERS, DEFAULT_TX_WAIT};
use std::time::Duration;

/// An application's idempotency settings: the engine (and so the store, the default lease and
/// the derive secret, [`Engine::builder`]) plus the HTTP defaults that routes without their
/// own arguments use. Built once by [`ConfigBuilder::build`], which
/// refuses unusable values, so nothing on the request path can panic on them.
#[derive(Debug, Clone)]
pub struct Config {
    pub(super) engine: Engine,
    pub(super) ttl: Duration,
    pub(super) max_response: usize,
    pub(super) max_request: usize,
    pub(super) request_body_timeout: Duration,
    pub(super) fail_open: bool,
    pub(super) commit: Option<CommitPath>,
    pub(super) tx_wait: Duration,
    pub(super) wait: Duration,
    pub(super) max_waiters: usize,
    pub(super) tx_read_first: bool,
}

impl Config {
    /// Settings over `engine` with the defaults (see [`ConfigBuilder`]). Nothing can be
    /// refused here, so the ttl is 24 h or, for an engine whose lease is longer, that lease (a
    /// ttl shorter than the lease would leave every route answering "misconfigured");
    /// [`ConfigBuilder::build`] instead refuses a ttl shorter than the lease.
    pub fn new(engine: Engine) -> Self {
        let mut config = Self::defaults(engine);
        config.ttl = config.engine.default_ttl();
        config
    }

    /// The defaults, without touching the engine (the builder configures it when it builds).
    fn defaults(engine: Engine) -> Self {
        Config {
            ttl: DEFAULT_TTL,
            engine,
            max_response: DEFAULT_MAX_RESPONSE,
            max_request: DEFAULT_MAX_REQUEST,
            request_body_timeout: DEFAULT_REQUEST_BODY_TIMEOUT,
            fail_open: false,
            commit: None,
            tx_wait: DEFAULT_TX_WAIT,
            wait: Duration::ZERO,
            max_waiters: DEFAULT_MAX_WAITERS,
            tx_read_first: true,
        }
    }

    /// The engine.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Default ttl.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Default limit on stored responses.
    pub fn max_response(&self) -> usize {
        self.max_response
    }

    /// Limit on request bodies read for fingerprinting.
    pub fn max_request(&self) -> usize {
        self.max_request
    }

    /// Time allowed to read a request body for fingerprinting.
    pub fn request_body_timeout(&self) -> Duration {
        self.request_body_timeout
    }

    /// Whether handlers run unprotected when the store fails.
    pub fn fail_open(&self) -> bool {
        self.fail_open
    }

    /// The commit path of transactional routes that pick none (`None`: each database's
    /// default, [`DEFAULT_COMMIT`](crate::tx::DEFAULT_COMMIT)).
    pub fn commit_path(&self) -> Option<CommitPath> {
        self.commit
    }

    /// The `wait` of plain routes whose attribute sets none ([`ConfigBuilder::wait`]).
    pub fn wait(&self) -> Duration {
        self.wait
    }

    /// Default [`TxOptions::wait`](crate::tx::TxOptions::wait).
    pub fn transaction_wait(&self) -> Duration {
        self.tx_wait
    }

    /// [`TxOptions::max_waiters`](crate::tx::TxOptions::max_waiters).
    pub fn max_waiters(&self) -> usize {
        self.max_waiters
    }

    /// [`TxOptions::read_first`](crate::tx::TxOptions::read_first).
    pub fn transaction_read_first(&self) -> bool {
        self.tx_read_first
    }
}

/// Builds a [`Config`] (or an adapter's configuration type `T`, made from one).
///
/// ```
/// use std::time::Duration;
/// use idempotent_core::{Engine, MemoryStore, http::{Config, ConfigBuilder, ConfigError}};
///
/// let engine = Engine::new(MemoryStore::new());
/// let config: Config = ConfigBuilder::new(engine.clone()).ttl(Duration::from_secs(3600)).build()?;
/// assert_eq!(config.ttl(), Duration::from_secs(3600));
/// let bad = ConfigBuilder::<Config>::new(engine).ttl(Duration::MAX).build();
/// assert!(matches!(bad, Err(ConfigError::TooLong { what: "ttl", .. })));
/// # Ok::<(), ConfigError>(())
/// ```
#[derive(Debug)]
#[must_use = "call `.build()`"]
pub struct ConfigBuilder<T = Config> {
    config: Config,
    into: std::marker::PhantomData<fn() -> T>,
}

impl<T: From<Config>> ConfigBuilder<T> {
    /// A builder over `engine` (whose lease and derive secret routes use), starting from the
    /// defaults: ttl 24 h, responses up to 1 MiB stored, request bodies up to 2 MiB, fail
    /// closed.
    pub fn new(engine: Engine) -> Self {
        ConfigBuilder {
            config: Config::defaults(engine),
            into: std::marker::PhantomData,
        }
    }

    /// Default ttl (how long a finished response is replayed) for routes that set none;
    /// 100 ms to 365 days, and at least the lease.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.config.ttl = ttl;
        self
    }

    /// Default limit on stored responses for routes that set none (larger ones are answered
    /// in full but not stored; retries get a 410 problem).
    pub fn max_response(mut self, bytes: usize) -> Self {
        self.config.max_response = bytes;
        self
    }

    /// Largest request body read for fingerprinting; larger requests get a 413 problem.
    pub fn max_request(mut self, bytes: usize) -> Self {
        self.config.max_request = bytes;
        self
    }

    /// How long reading a request body for fingerprinting may take, from when the
    /// idempotency layer starts reading it (waiting for its first byte included) to its last
    /// byte (default 30 s, 100 ms to 365 days). A client that sends its body
    /// slower (slowloris) gets a 408 problem and its connection's task is freed; no key is
    /// claimed before the body is read, so it never holds a record.
    pub fn request_body_timeout(mut self, timeout: Duration) -> Self {
        self.config.request_body_timeout = timeout;
        self
    }

    /// Run handlers unprotected when the store fails (default: refuse with 503). Never
    /// applies to transactional routes, whose transaction is on the store's database, nor to a
    /// record the store cannot read ([`StoreError::Corrupt`](crate::StoreError::Corrupt)):
    /// that request gets the 503.
    pub fn fail_open(mut self, on: bool) -> Self {
        self.config.fail_open = on;
        self
    }

    /// The commit path of transactional routes whose attribute sets no `commit` (default:
    /// single commit on PostgreSQL and SQLite; see [`crate::tx`]).
    pub fn commit_path(mut self, path: CommitPath) -> Self {
        self.config.commit = Some(path);
        self
    }

    /// How long a request whose key another open transaction holds waits for it before it
    /// gets 409, for transactional routes whose attribute sets no `wait` (default 50 ms;
    /// single commit on PostgreSQL).
    pub fn transaction_wait(mut self, wait: Duration) -> Self {
        self.config.tx_wait = wait;
        self
    }

    /// How long a request that finds its record in progress waits for that attempt's answer
    /// (then replays it, or runs the handler if the attempt released the key) before it gets
    /// 409, for plain routes whose attribute sets no `wait` (default zero: 409 at once; see
    /// [`Policy::wait`](crate::engine::Policy::wait)). At most the engine's lease. The bounds
    /// on waiters are the engine's
    /// ([`EngineBuilder::max_waiting`](crate::engine::EngineBuilder::max_waiting)).
    pub fn wait(mut self, wait: Duration) -> Self {
        self.config.wait = wait;
        self
    }

    /// Single commit on PostgreSQL: at most this many requests per key wait on the record's
    /// row lock in this process (default 4; each holds a pooled connection while it waits);
    /// more get 409 at once. 0: none waits.
    pub fn max_waiters(mut self, n: usize) -> Self {
        self.config.max_waiters = n;
        self
    }

    /// Single commit: read the record before opening a transaction, so a replay is one
    /// read-only statement (default `true`); `false` makes replays dearer and, on PostgreSQL,
    /// no longer saves first executions a round trip (see
    /// [`TxOptions::read_first`](crate::tx::TxOptions::read_first)).
    pub fn transaction_read_first(mut self, on: bool) -> Self {
        self.config.tx_read_first = on;
        self
    }

    /// Checks the settings once.
    ///
    /// # Errors
    /// [`ConfigError`] for a duration out of bounds, a ttl shorter than the lease, or a zero
    /// size limit.
    pub fn build(self) -> Result<T, ConfigError> {
        let c = self.config;
        check_ttl_and_lease(c.ttl, c.engine.lease())?;
        crate::engine::check_wait(c.wait, c.engine.lease())?;
        crate::engine::check_wait(c.tx_wait, c.engine.lease())?;
        if c.max_response == 0 {
            return Err(ConfigError::ZeroSize {
                what: "max_response",
            });
        }
        if c.max_request == 0 {
            return Err(ConfigError::ZeroSize {
                what: "max_request",
            });
        }
        check_duration("request_body_timeout", c.request_body_timeout)?;
        if c.tx_wait > MAX_DURATION {
            return Err(ConfigError::TooLong {
                what: "transaction_wait",
                value: c.tx_wait,
            });
        }
        Ok(T::from(c))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::KeyRequirement;
    use crate::http::route::{Route, RouteArgs};

    #[test]
    fn settings_are_checked_once() {
        let engine = || Engine::new(crate::store::MemoryStore::new());
        let build = |f: fn(ConfigBuilder) -> ConfigBuilder| f(ConfigBuilder::new(engine())).build();
        assert!(build(|b| b).is_ok());
        // The lease is the engine's, checked where it is set.
        let lease = |d| {
            Engine::builder(crate::store::MemoryStore::new())
                .lease(d)
                .build()
        };
        assert!(matches!(
            lease(Duration::ZERO),
            Err(ConfigError::TooShort { what: "lease", .. })
        ));
        assert!(matches!(
            lease(Duration::from_micros(500)),
            Err(ConfigError::TooShort { what: "lease", .. })
        ));
        assert!(matches!(
            lease(Duration::MAX),
            Err(ConfigError::TooLong { what: "lease", .. })
        ));
        assert!(matches!(
            build(|b| b.ttl(Duration::MAX)),
            Err(ConfigError::TooLong { what: "ttl", .. })
        ));
        assert!(matches!(
            build(|b| b.ttl(Duration::from_secs(1))),
            Err(ConfigError::TtlShorterThanLease { .. })
        ));
        assert_eq!(
            build(|b| b.max_response(0)).err(),
            Some(ConfigError::ZeroSize {
                what: "max_response"
            })
        );
        // A route's own ttl is checked against the engine's lease when resolved.
        let long_lease = Engine::builder(crate::store::MemoryStore::new())
            .lease(Duration::from_secs(300))
            .build()
            .expect("valid");
        let config = ConfigBuilder::<Config>::new(long_lease)
            .build()
            .expect("valid");
        let route = Route::new(RouteArgs {
            name: "create_charge",
            ttl: Some(Duration::from_secs(60)),
            lease: None,
            key: KeyRequirement::Required,
            store_server_errors: false,
            max_response: None,
        });
        assert!(matches!(
            route.resolve(&config),
            Err(ConfigError::TtlShorterThanLease { .. })
        ));
        let fine = Route::new(RouteArgs {
            name: "r",
            ttl: None,
            lease: Some(Duration::from_secs(1)),
            key: KeyRequirement::Optional,
            store_server_errors: true,
            max_response: Some(9),
        });
        let p = fine.resolve(&config).expect("valid");
        assert_eq!(p.policy.lease, Duration::from_secs(1));
        assert_eq!(p.policy.ttl, DEFAULT_TTL);
        assert_eq!(p.policy.route, "r");
        assert_eq!(p.max_response, 9);
        assert!(p.policy.store_server_errors);
    }

    /// An engine whose lease is longer than the default ttl: `Config::new` (which refuses
    /// nothing) gives routes that resolve, the builder refuses it once at build; never a
    /// configuration whose every route answers 500 at run time.
    #[test]
    fn the_default_ttl_covers_a_long_engine_lease() {
        let lease = Duration::from_secs(2 * 86_400);
        let engine = Engine::builder(crate::store::MemoryStore::new())
            .lease(lease)
            .build()
            .expect("valid");
        let plain = Route::new(RouteArgs {
            name: "r",
            ttl: None,
            lease: None,
            key: KeyRequirement::Required,
            store_server_errors: false,
            max_response: None,
        });
        let config = Config::new(engine.clone());
        assert_eq!(config.ttl(), lease);
        let resolved = plain.resolve(&config).expect("resolves");
        assert_eq!((resolved.policy.ttl, resolved.policy.lease), (lease, lease));
        // The builder refuses at build what it cannot resolve, as it always has: its default
        // ttl is 24 h, shorter than this lease; a ttl at least the lease builds.
        assert!(matches!(
            ConfigBuilder::<Config>::new(engine.clone()).build(),
            Err(ConfigError::TtlShorterThanLease { .. })
        ));
        let built = ConfigBuilder::<Config>::new(engine)
            .ttl(lease)
            .build()
            .expect("valid");
        assert!(plain.resolve(&built).is_ok());
        // The common case keeps its 24 h.
        assert_eq!(
            Config::new(Engine::new(crate::store::MemoryStore::new())).ttl(),
            DEFAULT_TTL
        );
    }
}
