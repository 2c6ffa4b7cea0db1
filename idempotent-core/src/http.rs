//! Everything about HTTP that is not a framework type, on plain types (`&str`, `&[u8]`, `u16`),
//! so the Axum and Actix adapters share one implementation and differ only in glue.
//!
//! - names: [`IDEMPOTENCY_KEY`], [`IDEMPOTENT_REPLAYED`], [`PROBLEM_JSON`];
//! - which requests are protected ([`is_safe_method`]) and the cheap checks that run before
//!   a body is read ([`check_key`], [`check_content_length`]);
//! - the application's settings ([`Config`], built and validated once by [`ConfigBuilder`]) and
//!   each route's arguments resolved against them ([`Route`] → [`RoutePolicy`]);
//! - the request's identity ([`RequestHead::fingerprint`]);
//! - the handler's response: which headers are stored ([`is_stored_header`]), a copy of the
//!   body bounded by the route's limit ([`Capture`]), how it is recorded ([`ResponsePlan`]) and
//!   the rules for a streamed body ([`Recorder`]);
//! - what to answer: one exhaustive map from the engine's [`Begin`] to a [`Step`], and the
//!   library's own [`Reply`]s (replays and RFC 9457 problems).

pub use crate::engine::{ConfigError, MAX_DURATION, MIN_DURATION};

use crate::engine::{Begin, Execution, Unprotected, check_duration, check_ttl_and_lease};
use crate::tx::{CommitPath, DEFAULT_MAX_WAITERS, DEFAULT_TX_WAIT, TxOptions};
use crate::{
    DEFAULT_LEASE, DEFAULT_TTL, DeriveSecret, Engine, Fingerprint, FingerprintInput,
    IdempotencyKey, Idempotent, KeyError, KeyRequirement, Policy, Problem, Recorded, Scope,
    ScopeError, StoredOutcome, StoredResponse,
};
use std::borrow::Cow;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// The request header carrying the key (lower case, as HTTP/2 and the `http` crates spell it).
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// The response header saying whether a response is a replay (`true`) or a first execution
/// (`false`).
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";
/// The media type of the library's error responses (RFC 9457).
pub const PROBLEM_JSON: &str = "application/problem+json";

/// Default limit on stored responses: 1 MiB.
pub const DEFAULT_MAX_RESPONSE: usize = 1 << 20;
/// Default limit on request bodies read for fingerprinting: 2 MiB.
pub const DEFAULT_MAX_REQUEST: usize = 2 << 20;
/// Default interval of the sweeper the configuration starts: 60 s.
pub const DEFAULT_SWEEP_EVERY: Duration = Duration::from_secs(60);
/// Default time allowed to read a request body for fingerprinting: 30 s.
pub const DEFAULT_REQUEST_BODY_TIMEOUT: Duration = Duration::from_secs(30);
/// Whether a method is safe (GET, HEAD, OPTIONS): its requests ignore the key and run.
///
/// ```
/// use idempotent_core::http::is_safe_method;
/// assert!(is_safe_method("GET") && !is_safe_method("POST") && !is_safe_method("PATCH"));
/// ```
pub fn is_safe_method(method: &str) -> bool {
    matches!(method, "GET" | "HEAD" | "OPTIONS")
}

/// Whether a response header is stored for replays. Hop-by-hop headers, `Date`,
/// `Content-Length` (replays are framed anew), `Set-Cookie` (a replay must not hand one
/// caller's session to a retry) and our own `Idempotent-Replayed` are not. `name` is
/// compared case-insensitively.
///
/// ```
/// use idempotent_core::http::is_stored_header;
/// assert!(is_stored_header("content-type") && is_stored_header("Location"));
/// assert!(!is_stored_header("Set-Cookie") && !is_stored_header("transfer-encoding"));
/// ```
pub fn is_stored_header(name: &str) -> bool {
    const NEVER: [&str; 13] = [
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "date",
        "content-length",
        "set-cookie",
        IDEMPOTENT_REPLAYED,
    ];
    !NEVER.iter().any(|n| n.eq_ignore_ascii_case(name))
}

/// The checks on the key that need neither the body nor the store, run first: a malformed key
/// is refused on every route, a missing one where the route requires it.
///
/// # Errors
/// The 400 problem to answer with.
///
/// ```
/// use idempotent_core::{IdempotencyKey, KeyRequirement, http::check_key};
/// let missing = IdempotencyKey::from_header_values::<&[u8]>([]);
/// assert_eq!(check_key(&missing, KeyRequirement::Required).unwrap_err().status, 400);
/// assert!(check_key(&missing, KeyRequirement::Optional).is_ok());
/// ```
pub fn check_key(
    key: &Result<IdempotencyKey, KeyError>,
    requirement: KeyRequirement,
) -> Result<(), Box<Problem>> {
    match key {
        Ok(_) => Ok(()),
        Err(KeyError::Missing) if requirement == KeyRequirement::Optional => Ok(()),
        Err(e) => Err(Box::new(Problem::key(e))),
    }
}

/// Refuses a request whose declared `Content-Length` is over the limit before its body is
/// read (an absent or unparsable header is left to the read itself).
///
/// # Errors
/// The 413 problem.
pub fn check_content_length(value: Option<&[u8]>, limit: usize) -> Result<(), Box<Problem>> {
    let declared = value
        .and_then(|v| std::str::from_utf8(v).ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    match declared {
        Some(n) if n > limit as u64 => Err(Box::new(Problem::request_too_large(limit))),
        _ => Ok(()),
    }
}

/// The parts of a request that identify it, borrowed from the framework's request.
#[derive(Debug, Clone, Copy)]
pub struct RequestHead<'a> {
    /// The method (`POST`).
    pub method: &'a str,
    /// The path as received, with any prefix a nested router stripped put back: never the
    /// route template, and not normalised.
    pub path: &'a str,
    /// The query string as sent, without `?`.
    pub query: Option<&'a str>,
    /// The `Content-Type` header, if it is valid text.
    pub content_type: Option<&'a str>,
}

/// The largest body [`RequestHead::fingerprint_async`] fingerprints on the async worker
/// itself: 8 KiB.
///
/// Measured (release build, 2-core machine): a fingerprint costs about 0.5 µs per KiB raw,
/// 3 µs per KiB of JSON and 6–9 µs per KiB of a typical form (up to about 50 µs per KiB for
/// a hostile form of one-byte fields out of order), while handing a closure to tokio's
/// blocking pool and back costs about 7 µs. At 8 KiB a fingerprint takes some 25–70 µs: the
/// hand-off would be a large share of that, and the worker is held up no longer than
/// tokio's guidance between awaits (10–100 µs). Above it the computation grows with the
/// body, the hand-off does not: a 2 MiB body costs 1–100 ms.
pub const FINGERPRINT_INLINE_MAX: usize = 8 << 10;

impl RequestHead<'_> {
    /// The request's fingerprint over this head and `body`, computed here and now (for a large
    /// body on an async worker, prefer [`RequestHead::fingerprint_async`]).
    pub fn fingerprint(&self, body: &[u8]) -> Fingerprint {
        Fingerprint::compute(&FingerprintInput {
            method: self.method,
            path: self.path,
            query: self.query,
            content_type: self.content_type,
            body,
        })
    }

    /// [`RequestHead::fingerprint`], off the async workers for a body above
    /// [`FINGERPRINT_INLINE_MAX`]: on tokio's blocking pool (`spawn_blocking`), so a 2 MiB
    /// form or JSON body does not hold up the other requests of its worker thread (on
    /// actix-web's single-threaded runtimes too, which have a blocking pool). Smaller bodies,
    /// and any body outside a tokio runtime, are fingerprinted inline. The body is owned
    /// (`Bytes`, `Vec<u8>`) because the computation may outlive this future's borrow.
    ///
    /// Never fails: if the blocking task cannot give an answer (the runtime is shutting down
    /// and refused it, or it panicked), the fingerprint is computed inline instead, so the
    /// request is still answered.
    ///
    /// ```
    /// use idempotent_core::http::RequestHead;
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let head = RequestHead {
    ///     method: "POST", path: "/v1/charges", query: None,
    ///     content_type: Some("application/json"),
    /// };
    /// let body = vec![b' '; 1 << 20]; // 1 MiB of whitespace: hashed raw, off the worker
    /// assert_eq!(head.fingerprint_async(body.clone()).await, head.fingerprint(&body));
    /// # }
    /// ```
    pub async fn fingerprint_async<B>(&self, body: B) -> Fingerprint
    where
        B: AsRef<[u8]> + Send + Sync + 'static,
    {
        if body.as_ref().len() <= FINGERPRINT_INLINE_MAX {
            return self.fingerprint(body.as_ref());
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return self.fingerprint(body.as_ref());
        };
        // Shared, so the body is still here for the inline fallback.
        let body = std::sync::Arc::new(body);
        let task = {
            let body = std::sync::Arc::clone(&body);
            let (method, path) = (self.method.to_owned(), self.path.to_owned());
            let query = self.query.map(str::to_owned);
            let content_type = self.content_type.map(str::to_owned);
            runtime.spawn_blocking(move || {
                RequestHead {
                    method: &method,
                    path: &path,
                    query: query.as_deref(),
                    content_type: content_type.as_deref(),
                }
                .fingerprint((*body).as_ref())
            })
        };
        match task.await {
            Ok(fingerprint) => fingerprint,
            Err(error) => {
                tracing::warn!(%error, "idempotency: fingerprinting on the blocking pool failed; computed inline");
                self.fingerprint((*body).as_ref())
            }
        }
    }
}

/// An application's idempotency settings: the engine (and so the store) plus the defaults that
/// routes without their own arguments use. Built once by [`ConfigBuilder::build`], which
/// refuses unusable values, so nothing on the request path can panic on them.
#[derive(Debug, Clone)]
pub struct Config {
    engine: Engine,
    ttl: Duration,
    lease: Duration,
    max_response: usize,
    max_request: usize,
    request_body_timeout: Duration,
    sweep_every: Option<Duration>,
    fail_open: bool,
    commit: Option<CommitPath>,
    tx_wait: Duration,
    max_waiters: usize,
    tx_read_first: bool,
    derive_secret: Option<DeriveSecret>,
}

impl Config {
    /// Settings over `engine` with the defaults (see [`ConfigBuilder`]), the automatic
    /// sweeper included.
    pub fn new(engine: Engine) -> Self {
        engine.inner.auto_sweep.configure(Some(DEFAULT_SWEEP_EVERY));
        Self::defaults(engine)
    }

    /// The defaults, without touching the engine (the builder configures it when it builds).
    fn defaults(engine: Engine) -> Self {
        Config {
            engine,
            ttl: DEFAULT_TTL,
            lease: DEFAULT_LEASE,
            max_response: DEFAULT_MAX_RESPONSE,
            max_request: DEFAULT_MAX_REQUEST,
            request_body_timeout: DEFAULT_REQUEST_BODY_TIMEOUT,
            sweep_every: Some(DEFAULT_SWEEP_EVERY),
            fail_open: false,
            commit: None,
            tx_wait: DEFAULT_TX_WAIT,
            max_waiters: DEFAULT_MAX_WAITERS,
            tx_read_first: true,
            derive_secret: None,
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

    /// Default lease.
    pub fn lease(&self) -> Duration {
        self.lease
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

    /// The interval of the sweeper this configuration starts, or `None` (turned off).
    pub fn sweep_every(&self) -> Option<Duration> {
        self.sweep_every
    }

    /// Whether handlers run unprotected when the store fails.
    pub fn fail_open(&self) -> bool {
        self.fail_open
    }

    /// The commit path of transactional routes that pick none (`None`: each database's
    /// default, [`TxDatabase::DEFAULT_COMMIT`](crate::TxDatabase::DEFAULT_COMMIT)).
    pub fn commit_path(&self) -> Option<CommitPath> {
        self.commit
    }

    /// Default [`TxOptions::wait`].
    pub fn transaction_wait(&self) -> Duration {
        self.tx_wait
    }

    /// [`TxOptions::max_waiters`].
    pub fn max_waiters(&self) -> usize {
        self.max_waiters
    }

    /// [`TxOptions::read_first`].
    pub fn transaction_read_first(&self) -> bool {
        self.tx_read_first
    }

    /// The secret downstream keys are derived under ([`ConfigBuilder::derive_secret`]).
    pub fn derive_secret(&self) -> Option<&DeriveSecret> {
        self.derive_secret.as_ref()
    }
}

/// Builds a [`Config`] (or an adapter's configuration type `T`, made from one).
///
/// ```
/// use std::time::Duration;
/// use idempotent_core::{Engine, MemoryStore, http::{Config, ConfigBuilder, ConfigError}};
///
/// let engine = Engine::new(MemoryStore::new());
/// let config: Config = ConfigBuilder::new(engine.clone()).lease(Duration::from_secs(10)).build()?;
/// assert_eq!(config.lease(), Duration::from_secs(10));
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
    /// A builder over `engine`, starting from the defaults: ttl 24 h, lease 30 s, responses up
    /// to 1 MiB stored, request bodies up to 2 MiB, fail closed.
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

    /// Default lease (how long a crashed attempt blocks retries) for routes that set none;
    /// 100 ms to 365 days.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.config.lease = lease;
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

    /// How often the sweeper deletes expired records (default every 60 s, 100 ms to 365
    /// days). The configuration starts it with its first request, on that request's tokio
    /// runtime, once however many workers share the configuration (Actix builds its `App`
    /// once per worker: still one sweeper), and the adapter's drain stops it. Records past
    /// their ttl count as absent whether or not they were swept; the sweeper only frees the
    /// space. Deletes in batches of 1,000, at most 100 batches per round.
    pub fn sweep_every(mut self, interval: Duration) -> Self {
        self.config.sweep_every = Some(interval);
        self
    }

    /// No automatic sweeper (run [`Sweeper`](crate::Sweeper) yourself, or delete expired
    /// records another way).
    pub fn no_sweeper(mut self) -> Self {
        self.config.sweep_every = None;
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

    /// At most this many requests per key wait in this process (default 4); more get 409 at
    /// once. 0: none waits.
    pub fn max_waiters(mut self, n: usize) -> Self {
        self.config.max_waiters = n;
        self
    }

    /// Single commit: read the record before opening a transaction, so a replay is one
    /// read-only statement (default `true`); `false` saves first executions that round trip
    /// (see [`TxOptions::read_first`]).
    pub fn transaction_read_first(mut self, on: bool) -> Self {
        self.config.tx_read_first = on;
        self
    }

    /// The secret that handlers' downstream keys ([`Idempotent::derive`]) are derived under;
    /// required by every handler that takes an [`Idempotent`] parameter. No default: see
    /// [`DeriveSecret`] for why, and for rotation.
    ///
    /// ```
    /// use idempotent_core::{DeriveSecret, Engine, MemoryStore, http::{Config, ConfigBuilder}};
    ///
    /// // e.g. from `std::env::var("IDEMPOTENCY_SECRET")`, the same on every instance
    /// let secret = DeriveSecret::new("a long random string from the secret manager")?;
    /// let config: Config = ConfigBuilder::new(Engine::new(MemoryStore::new()))
    ///     .derive_secret(secret)
    ///     .build()?;
    /// assert!(config.derive_secret().is_some());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn derive_secret(mut self, secret: DeriveSecret) -> Self {
        self.config.derive_secret = Some(secret);
        self
    }

    /// Checks the settings once.
    ///
    /// # Errors
    /// [`ConfigError`] for a duration out of bounds, a ttl shorter than the lease, or a zero
    /// size limit.
    pub fn build(self) -> Result<T, ConfigError> {
        let c = self.config;
        check_ttl_and_lease(c.ttl, c.lease)?;
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
        if let Some(every) = c.sweep_every {
            check_duration("sweep_every", every)?;
        }
        if c.tx_wait > MAX_DURATION {
            return Err(ConfigError::TooLong {
                what: "transaction_wait",
                value: c.tx_wait,
            });
        }
        // Only a configuration that is built touches its engine.
        c.engine.inner.auto_sweep.configure(c.sweep_every);
        if let Some(secret) = &c.derive_secret {
            // Every instance sharing the secret logs the same hash for one record.
            c.engine.inner.log_key.set_from(secret);
        }
        Ok(T::from(c))
    }
}

/// One route's attribute arguments, as `#[idempotent]` writes them (a `static` per handler);
/// `None` takes the [`Config`]'s default.
#[derive(Debug)]
pub struct Route {
    name: &'static str,
    ttl: Option<Duration>,
    lease: Option<Duration>,
    key: KeyRequirement,
    store_server_errors: bool,
    max_response: Option<usize>,
    commit: Option<CommitPath>,
    wait: Option<Duration>,
    reported: AtomicBool,
    reported_secret: AtomicBool,
}

/// A route's arguments resolved against the application's [`Config`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoutePolicy {
    /// What the engine needs.
    pub policy: Policy,
    /// The limit on stored responses.
    pub max_response: usize,
}

impl Route {
    /// A route named `name` (the handler's name, for logs) with its arguments.
    pub const fn new(
        name: &'static str,
        ttl: Option<Duration>,
        lease: Option<Duration>,
        key: KeyRequirement,
        store_server_errors: bool,
        max_response: Option<usize>,
    ) -> Self {
        Route {
            name,
            ttl,
            lease,
            key,
            store_server_errors,
            max_response,
            commit: None,
            wait: None,
            reported: AtomicBool::new(false),
            reported_secret: AtomicBool::new(false),
        }
    }

    /// The attribute's `commit` and `wait` of a transactional route (`None` takes the
    /// configuration's default).
    #[must_use]
    pub const fn transactional(
        mut self,
        commit: Option<CommitPath>,
        wait: Option<Duration>,
    ) -> Self {
        self.commit = commit;
        self.wait = wait;
        self
    }

    /// The transactional settings of this route under `config`; `database_default` is the
    /// commit path of the database when neither sets one.
    pub fn tx_options(&self, config: &Config, database_default: CommitPath) -> TxOptions {
        TxOptions {
            commit: self.commit.or(config.commit).unwrap_or(database_default),
            wait: self.wait.unwrap_or(config.tx_wait),
            max_waiters: config.max_waiters,
            read_first: config.tx_read_first,
        }
    }

    /// The handler's name.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Whether the route requires a key.
    pub fn key(&self) -> KeyRequirement {
        self.key
    }

    /// Resolves the arguments against `config`. The attribute checked what it could at compile
    /// time; what depends on the configuration (a route's ttl under the configured lease) is
    /// checked here, and the first failure per route is logged (`tracing`, error level) with
    /// the route's name.
    ///
    /// # Errors
    /// [`ConfigError`]: answer with [`Problem::misconfigured`], never run the handler.
    pub fn resolve(&self, config: &Config) -> Result<RoutePolicy, ConfigError> {
        let policy = Policy {
            ttl: self.ttl.unwrap_or(config.ttl),
            lease: self.lease.unwrap_or(config.lease),
            store_server_errors: self.store_server_errors,
            key: self.key,
            fail_open: config.fail_open,
            route: self.name,
        };
        match check_ttl_and_lease(policy.ttl, policy.lease) {
            Ok(()) => Ok(RoutePolicy {
                policy,
                max_response: self.max_response.unwrap_or(config.max_response),
            }),
            Err(e) => {
                if !self.reported.swap(true, Ordering::Relaxed) {
                    tracing::error!(
                        route = self.name,
                        error = %e,
                        "idempotency: this route's arguments do not fit the configuration; its requests are answered 500 until fixed"
                    );
                }
                Err(e)
            }
        }
    }
}

/// The [`Idempotent`] context for a handler parameter: keyed by (scope, key) when the request
/// runs under a key, [`Idempotent::unkeyed`] when it runs without one (a safe method, or no
/// key where it is optional; also when the scope failed, whose request never reaches the
/// handler).
///
/// # Errors
/// [`Problem::misconfigured`] when the configuration has no [`DeriveSecret`] (logged once per
/// route, with its name): the handler must not run, since its downstream keys would not be
/// stable.
pub fn idempotent_context(
    config: &Config,
    route: &Route,
    method: &str,
    key: &Result<IdempotencyKey, KeyError>,
    scope: &Result<Scope, ScopeError>,
) -> Result<Idempotent, Box<Problem>> {
    let Some(secret) = config.derive_secret() else {
        if !route.reported_secret.swap(true, Ordering::Relaxed) {
            tracing::error!(
                route = route.name,
                "idempotency: this handler takes an `Idempotent` parameter but the configuration has no derive secret (`derive_secret`); its requests are answered 500 until one is set"
            );
        }
        return Err(Box::new(Problem::misconfigured()));
    };
    Ok(match (key, scope) {
        (Ok(key), Ok(scope)) if !is_safe_method(method) => Idempotent::keyed(secret, scope, key),
        _ => Idempotent::unkeyed(),
    })
}

/// A response the library produces itself (a replay or a problem), on plain types.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    /// HTTP status.
    pub status: u16,
    /// Header lines in order (names lower case); repeated names appear repeatedly.
    pub headers: Vec<(Cow<'static, str>, Cow<'static, [u8]>)>,
    /// The body.
    pub body: Vec<u8>,
}

impl Reply {
    /// A stored response as its replay: status, every stored header in order, the body, and
    /// `Idempotent-Replayed: true`.
    pub fn replay(stored: StoredResponse) -> Self {
        let mut headers: Vec<(Cow<'static, str>, Cow<'static, [u8]>)> =
            Vec::with_capacity(stored.headers.len() + 1);
        headers.extend(
            stored
                .headers
                .into_iter()
                .filter(|(name, _)| !name.eq_ignore_ascii_case(IDEMPOTENT_REPLAYED))
                .map(|(n, v)| (Cow::Owned(n), Cow::Owned(v))),
        );
        headers.push((Cow::Borrowed(IDEMPOTENT_REPLAYED), Cow::Borrowed(b"true")));
        Reply {
            status: stored.status,
            headers,
            body: stored.body,
        }
    }

    /// A problem as `application/problem+json` with `Cache-Control: no-store` and, when set,
    /// `Retry-After`.
    pub fn problem(p: &Problem) -> Self {
        let mut headers: Vec<(Cow<'static, str>, Cow<'static, [u8]>)> = vec![
            (
                Cow::Borrowed("content-type"),
                Cow::Borrowed(PROBLEM_JSON.as_bytes()),
            ),
            (Cow::Borrowed("cache-control"), Cow::Borrowed(b"no-store")),
        ];
        if let Some(secs) = p.retry_after {
            headers.push((
                Cow::Borrowed("retry-after"),
                Cow::Owned(secs.to_string().into_bytes()),
            ));
        }
        Reply {
            status: p.status,
            headers,
            body: p.to_json(),
        }
    }
}

/// The header a first execution's response carries: `Idempotent-Replayed: false`.
pub const FIRST_EXECUTION: (&str, &str) = (IDEMPOTENT_REPLAYED, "false");

/// What to do with a request after [`Engine::begin`]. Deliberately exhaustive: an adapter
/// matches all three, with no wildcard arm for a variant it does not know.
#[derive(Debug)]
pub enum Step {
    /// Run the handler under this execution, capture its response, finish the execution.
    Execute(Execution),
    /// Run the handler without a record (no key on an optional route, or fail-open).
    Unprotected,
    /// Answer with this; the handler does not run.
    Respond(Reply),
}

impl From<Begin> for Step {
    /// The one map from the engine's answer to the wire: exhaustive, so a new variant is a
    /// compile error here rather than a run-time 500.
    fn from(begin: Begin) -> Self {
        match begin {
            Begin::Claimed(execution) => Step::Execute(execution),
            Begin::Replay(StoredOutcome::Response(stored)) => Step::Respond(Reply::replay(stored)),
            Begin::Replay(StoredOutcome::Oversized { status, size }) => {
                Step::Respond(Reply::problem(&Problem::response_not_stored(status, size)))
            }
            Begin::InProgress { retry_after } => {
                Step::Respond(Reply::problem(&Problem::in_progress(retry_after)))
            }
            Begin::Mismatch { in_progress } => {
                Step::Respond(Reply::problem(&Problem::mismatch(in_progress)))
            }
            Begin::KeyRejected(e) => Step::Respond(Reply::problem(&Problem::key(&e))),
            Begin::Unprotected(Unprotected::NoKey | Unprotected::FailedOpen(_)) => {
                Step::Unprotected
            }
            Begin::StoreUnavailable(_) => {
                Step::Respond(Reply::problem(&Problem::store_unavailable()))
            }
            Begin::Draining => Step::Respond(Reply::problem(&Problem::shutting_down())),
            Begin::Misconfigured(_) => Step::Respond(Reply::problem(&Problem::misconfigured())),
        }
    }
}

/// What an adapter does next on a transactional route ([`TxBegin`](crate::TxBegin) on the
/// wire): run the handler with the execution's transaction, or answer.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
#[derive(Debug)]
// Made and taken apart once per request: boxing the large variant would only add an allocation.
#[allow(clippy::large_enum_variant)]
pub enum TxStep<DB: crate::TxDatabase> {
    /// Run the handler with this transaction (under [`TxExecution::run`](crate::TxExecution::run)),
    /// read its whole response, then [`finish_transactional`].
    Run(crate::TxExecution<DB>, crate::Transaction<DB>),
    /// Answer with this; the handler does not run.
    Respond(Reply),
}

#[cfg(any(feature = "sqlite", feature = "postgres"))]
impl<DB: crate::TxDatabase> From<crate::TxBegin<DB>> for TxStep<DB> {
    fn from(begin: crate::TxBegin<DB>) -> Self {
        match begin {
            crate::TxBegin::Run(mut execution) => match execution.transaction() {
                Some(tx) => TxStep::Run(execution, tx),
                // A fresh execution always holds its transaction.
                None => TxStep::Respond(Reply::problem(&Problem::misconfigured())),
            },
            crate::TxBegin::Respond(begin) => match Step::from(begin) {
                Step::Respond(reply) => TxStep::Respond(reply),
                // `begin_transactional` never answers with these.
                Step::Execute(_) | Step::Unprotected => {
                    TxStep::Respond(Reply::problem(&Problem::misconfigured()))
                }
            },
            // The engine logged which database the route wants and what the store is; the
            // client is told nothing of the server's wiring.
            crate::TxBegin::WrongStore { .. } => {
                TxStep::Respond(Reply::problem(&Problem::misconfigured()))
            }
        }
    }
}

/// Begins a transactional route's request: claimed under `options` when `request` is
/// protected, or with a transaction and no record (`None`: a safe method, or no key where it
/// is optional).
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub async fn begin_transactional<DB: crate::TxDatabase>(
    engine: &Engine,
    request: Option<crate::ExecuteRequest>,
    policy: &crate::Policy,
    options: &TxOptions,
) -> TxStep<DB> {
    let begin = match request {
        Some(request) => {
            engine
                .begin_transactional::<DB>(request, policy, options)
                .await
        }
        None => engine.begin_unprotected::<DB>(policy).await,
    };
    TxStep::from(begin)
}

/// What the client gets after [`finish_transactional`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TxReply {
    /// Send the handler's response (its body as read); `first_execution`: add
    /// [`FIRST_EXECUTION`] (the response was stored).
    Send {
        /// Whether the response was stored with the commit.
        first_execution: bool,
    },
    /// Answer with this instead (the commit failed: nothing of the handler's is sent).
    Respond(Reply),
}

/// Finishes a transactional execution with the handler's whole response: stores it (up to
/// `limit` bytes; larger ones store the oversized marker) and commits, or rolls back when the
/// route does not store its status. Nothing can be sent before COMMIT, so the adapter reads
/// the whole body first (a failed body: [`TxExecution::abort`](crate::TxExecution::abort)
/// and [`Problem::response_failed`]).
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub async fn finish_transactional<'a, DB: crate::TxDatabase>(
    execution: crate::TxExecution<DB>,
    status: u16,
    headers: impl IntoIterator<Item = (&'a str, &'a [u8])>,
    body: &[u8],
    limit: usize,
) -> TxReply {
    let mut capture = Capture::new(status, headers, limit);
    capture.push(body);
    let protected = execution.is_protected();
    match execution.finish(capture.finish()).await {
        crate::TxFinished::Committed => TxReply::Send {
            first_execution: protected,
        },
        crate::TxFinished::RolledBack => TxReply::Send {
            first_execution: false,
        },
        crate::TxFinished::Failed(_) => {
            TxReply::Respond(Reply::problem(&Problem::store_unavailable()))
        }
        crate::TxFinished::Escaped => TxReply::Respond(Reply::problem(&Problem::misconfigured())),
    }
}

/// How a claimed execution's response is recorded, decided from its status and declared size
/// (the same rules for every adapter).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResponsePlan {
    /// The route does not store this status (5xx, 408/409/425/429): release the key, then send
    /// the response untouched.
    Release,
    /// The body's size is known and within the limit (a JSON response already in memory):
    /// read it whole, store it, then send it, so a client that got the response can retry and
    /// get the replay.
    Collect,
    /// The body is known to be over the limit: store the oversized marker, then stream it.
    Oversized {
        /// The declared size.
        size: u64,
    },
    /// The size is unknown (a stream): send it as it is produced through a [`Recorder`].
    Stream,
}

impl ResponsePlan {
    /// The plan for a response with `status` and, if known, an exact body size.
    ///
    /// ```
    /// use idempotent_core::{Policy, http::ResponsePlan};
    /// let p = Policy::default();
    /// assert_eq!(ResponsePlan::new(&p, 503, Some(10), 100), ResponsePlan::Release);
    /// assert_eq!(ResponsePlan::new(&p, 201, Some(10), 100), ResponsePlan::Collect);
    /// assert_eq!(ResponsePlan::new(&p, 200, Some(101), 100), ResponsePlan::Oversized { size: 101 });
    /// assert_eq!(ResponsePlan::new(&p, 200, None, 100), ResponsePlan::Stream);
    /// ```
    pub fn new(policy: &Policy, status: u16, exact_size: Option<u64>, limit: usize) -> Self {
        if !policy.stores(status) {
            return ResponsePlan::Release;
        }
        match exact_size {
            Some(size) if size <= limit as u64 => ResponsePlan::Collect,
            Some(size) => ResponsePlan::Oversized { size },
            None => ResponsePlan::Stream,
        }
    }
}

/// Records a response body as it goes to the client: owns the claimed [`Execution`] and a
/// bounded [`Capture`], and finishes the execution the way the body ends. An adapter feeds it
/// from its framework's body type; the rules are here:
///
/// - it ends within the limit ([`Recorder::end`]): the copy is stored;
/// - it passes the limit ([`Recorder::data`] returns `false`, then [`Recorder::over_limit`]):
///   the oversized marker is stored, the rest goes through uncopied, and a later error leaves
///   the marker (the handler ran);
/// - it fails before either ([`Recorder::fail`]): nothing is stored, the key is released;
/// - the client goes away first ([`Recorder::abandon`]): the rest is read on the server, for
///   at most one lease, so the outcome is stored and a retry gets the replay, never a second
///   run; a stream that has not ended by then is stored as the oversized marker and dropped;
/// - it produces nothing for a whole lease ([`Recorder::poll_expired`]): the oversized marker
///   is stored (retries get 410) and the rest goes through uncopied. A slow stream that keeps
///   producing is recorded to its end; an idle or endless one (server-sent events waiting for
///   an event) never holds its key in progress for longer than a lease of silence, whether or
///   not the framework notices a client that left meanwhile.
#[derive(Debug)]
pub struct Recorder {
    capture: Capture,
    execution: Execution,
    /// When recording gives up if nothing more arrives (streamed bodies only).
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Recorder {
    /// A recorder for a body read whole before it is sent ([`ResponsePlan::Collect`]).
    pub fn new(execution: Execution, capture: Capture) -> Self {
        Recorder {
            capture,
            execution,
            deadline: None,
        }
    }

    /// A recorder for a body streamed to the client ([`ResponsePlan::Stream`]): the lease is
    /// kept alive by its own task from now on, since a client that stops reading for a while
    /// stops the body being polled.
    pub fn streaming(mut execution: Execution, capture: Capture) -> Self {
        execution.keep_alive();
        let deadline = Box::pin(tokio::time::sleep(execution.policy().lease));
        Recorder {
            capture,
            execution,
            deadline: Some(deadline),
        }
    }

    /// Ready once a streamed body has produced nothing for a whole lease: then call
    /// [`Recorder::over_limit`] and let the rest through uncopied. Registers a wake-up with `cx`
    /// until then, so an idle stream is woken for it. Never ready for [`Recorder::new`].
    pub fn poll_expired(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        match self.deadline.as_mut() {
            Some(deadline) => deadline.as_mut().poll(cx),
            None => std::task::Poll::Pending,
        }
    }

    /// Runs `fut` (reading the body) under the execution: the lease stays alive and a panic is
    /// caught (see [`Execution::run`]).
    ///
    /// # Errors
    /// The panic's payload, if `fut` panicked.
    pub async fn run<F: std::future::Future>(
        &mut self,
        fut: F,
    ) -> Result<F::Output, crate::PanicPayload> {
        self.execution.run(fut).await
    }

    /// The next bytes of the body; `false` once it has passed the limit: call
    /// [`Recorder::over_limit`] then.
    pub fn data(&mut self, chunk: &[u8]) -> bool {
        if let Some(deadline) = self.deadline.as_mut() {
            let lease = self.execution.policy().lease;
            deadline.as_mut().reset(tokio::time::Instant::now() + lease);
        }
        self.capture.push(chunk)
    }

    /// The body passed the limit: stores the oversized marker.
    pub async fn over_limit(self) -> Recorded {
        let marker = StoredOutcome::Oversized {
            status: self.capture.status(),
            size: self.capture.size(),
        };
        self.execution.finish(marker).await
    }

    /// The body ended: stores the copy (or the marker, if it passed the limit).
    pub async fn end(self) -> Recorded {
        self.execution.finish(self.capture.finish()).await
    }

    /// The body failed before it could be stored: releases the key.
    pub async fn fail(self, error: &(dyn std::fmt::Display + Sync)) -> Recorded {
        tracing::error!(
            route = self.execution.policy().route,
            error = %error,
            "idempotency: the handler's response body failed before it could be stored; the key is released"
        );
        self.execution.release().await
    }

    /// The client went away before the end: reads the `rest` of the body (bounded, see the
    /// type's docs) and finishes as it ends.
    pub async fn abandon<S, B, E>(mut self, rest: S) -> Recorded
    where
        S: futures_util::Stream<Item = Result<B, E>>,
        B: AsRef<[u8]>,
        E: std::fmt::Display,
    {
        use futures_util::StreamExt;
        let deadline = tokio::time::Instant::now() + self.execution.policy().lease;
        let capture = &mut self.capture;
        let read = async {
            let mut rest = std::pin::pin!(rest);
            while let Some(chunk) = rest.next().await {
                if !capture.push(chunk?.as_ref()) {
                    break;
                }
            }
            Ok::<(), E>(())
        };
        let read = self
            .execution
            .run(tokio::time::timeout_at(deadline, read))
            .await;
        match read {
            Ok(Ok(Ok(()))) => self.end().await,
            Ok(Ok(Err(error))) => {
                let reason = error.to_string();
                self.fail(&reason).await
            }
            Ok(Err(_elapsed)) => {
                tracing::warn!(
                    route = self.execution.policy().route,
                    "idempotency: a streamed response whose client left did not end within a lease; stored as not replayable"
                );
                self.over_limit().await
            }
            Err(_panic) => self.execution.release().await,
        }
    }
}

/// A copy of a response for storing: its status, its storable headers, and its body up to a
/// limit. The response itself goes to the client untouched (as it is produced, for streams);
/// this only keeps what a replay needs, and stops keeping bytes once the body passes the limit.
///
/// ```
/// use idempotent_core::{StoredOutcome, http::Capture};
/// let mut c = Capture::new(201, [("content-type", &b"text/plain"[..]), ("date", b"x")], 5);
/// assert!(c.push(b"hel"));
/// assert!(c.push(b"lo"));
/// let StoredOutcome::Response(r) = c.finish() else { unreachable!() };
/// assert_eq!((r.body.as_slice(), r.headers.len()), (&b"hello"[..], 1));
///
/// let mut c = Capture::new(200, [], 3);
/// assert!(!c.push(b"four"));
/// assert_eq!(c.finish(), StoredOutcome::Oversized { status: 200, size: 4 });
/// ```
#[derive(Debug)]
pub struct Capture {
    status: u16,
    headers: Vec<(String, Vec<u8>)>,
    body: Vec<u8>,
    limit: usize,
    size: u64,
}

impl Capture {
    /// Starts a copy of a response with `status` and `headers` (only the storable ones are
    /// kept), keeping at most `limit` body bytes.
    pub fn new<'a>(
        status: u16,
        headers: impl IntoIterator<Item = (&'a str, &'a [u8])>,
        limit: usize,
    ) -> Self {
        Capture {
            status,
            headers: headers
                .into_iter()
                .filter(|(n, _)| is_stored_header(n))
                .map(|(n, v)| (n.to_ascii_lowercase(), v.to_vec()))
                .collect(),
            body: Vec::new(),
            limit,
            size: 0,
        }
    }

    /// Adds the next body bytes; `false` once the body has passed the limit (the copy is
    /// dropped then, and later bytes are only counted).
    pub fn push(&mut self, chunk: &[u8]) -> bool {
        self.size += chunk.len() as u64;
        if self.is_over() {
            self.body = Vec::new();
            false
        } else {
            self.body.extend_from_slice(chunk);
            true
        }
    }

    /// Whether the body has passed the limit.
    pub fn is_over(&self) -> bool {
        self.size > self.limit as u64
    }

    /// Body bytes seen so far.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The status.
    pub fn status(&self) -> u16 {
        self.status
    }

    /// What to store: the response, or the oversized marker once it passed the limit.
    pub fn finish(self) -> StoredOutcome {
        if self.is_over() {
            StoredOutcome::Oversized {
                status: self.status,
                size: self.size,
            }
        } else {
            StoredOutcome::Response(StoredResponse {
                status: self.status,
                headers: self.headers,
                body: self.body,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_filter() {
        for never in [
            "Connection",
            "keep-alive",
            "Proxy-Authenticate",
            "proxy-authorization",
            "proxy-connection",
            "TE",
            "trailer",
            "Transfer-Encoding",
            "upgrade",
            "Date",
            "content-length",
            "Set-Cookie",
            "Idempotent-Replayed",
        ] {
            assert!(!is_stored_header(never), "{never} must not be stored");
        }
        for kept in [
            "content-type",
            "location",
            "etag",
            "cache-control",
            "x-request-id",
            "link",
            "content-encoding",
        ] {
            assert!(is_stored_header(kept), "{kept} must be stored");
        }
        // Capture applies the filter and keeps repeats in order.
        let c = Capture::new(
            201,
            [
                ("x-a", &b"1"[..]),
                ("set-cookie", b"s=1"),
                ("x-a", b"2"),
                ("date", b"now"),
                ("idempotent-replayed", b"false"),
                ("Content-Length", b"2"),
            ],
            10,
        );
        let StoredOutcome::Response(r) = c.finish() else {
            panic!("oversized")
        };
        assert_eq!(
            r.headers,
            vec![
                ("x-a".to_owned(), b"1".to_vec()),
                ("x-a".to_owned(), b"2".to_vec())
            ]
        );
    }

    #[test]
    fn replay_never_echoes_a_stored_replayed_header() {
        let stored = StoredResponse::new(201, "b")
            .with_header("Idempotent-Replayed", "false")
            .with_header("x", "1")
            .with_header("x", "2");
        let reply = Reply::replay(stored);
        let headers: Vec<(&str, &[u8])> = reply
            .headers
            .iter()
            .map(|(n, v)| (n.as_ref(), v.as_ref()))
            .collect();
        assert_eq!(
            headers,
            vec![
                ("x", &b"1"[..]),
                ("x", b"2"),
                ("idempotent-replayed", b"true")
            ]
        );
        assert_eq!((reply.status, reply.body.as_slice()), (201, &b"b"[..]));
    }

    #[test]
    fn problems_carry_their_headers() {
        let r = Reply::problem(&Problem::in_progress(Duration::from_millis(2500)));
        assert_eq!(r.status, 409);
        let find = |n: &str| {
            r.headers
                .iter()
                .find(|(k, _)| k == n)
                .map(|(_, v)| v.to_vec())
        };
        assert_eq!(find("content-type"), Some(PROBLEM_JSON.as_bytes().to_vec()));
        assert_eq!(find("cache-control"), Some(b"no-store".to_vec()));
        assert_eq!(find("retry-after"), Some(b"3".to_vec()));
        let body: serde_json::Value = serde_json::from_slice(&r.body).expect("json");
        assert_eq!(body["status"], 409);
        assert_eq!(
            body["type"],
            "https://idempotent.dev/problems/idempotency-key-in-progress"
        );
    }

    #[test]
    fn capture_limits() {
        let mut c = Capture::new(200, [], 4);
        assert!(c.push(b"ab") && c.push(b"cd"));
        assert!(!c.is_over());
        assert!(!c.push(b"e"));
        assert!(!c.push(b"fgh"));
        assert_eq!(c.size(), 8);
        assert_eq!(
            c.finish(),
            StoredOutcome::Oversized {
                status: 200,
                size: 8
            }
        );
        // Exactly at the limit is stored.
        let mut c = Capture::new(204, [], 2);
        assert!(c.push(b"ok"));
        assert!(matches!(c.finish(), StoredOutcome::Response(r) if r.body == b"ok"));
    }

    #[test]
    fn cheap_checks() {
        assert!(check_content_length(Some(b"10"), 10).is_ok());
        assert_eq!(
            check_content_length(Some(b"11"), 10).map_err(|p| p.status),
            Err(413)
        );
        assert!(check_content_length(Some(b"junk"), 10).is_ok());
        assert!(check_content_length(None, 10).is_ok());
        let bad = IdempotencyKey::parse(b"");
        assert_eq!(
            check_key(&bad, KeyRequirement::Optional).map_err(|p| p.slug),
            Err("idempotency-key-invalid"),
            "a malformed key is never optional"
        );
        let missing = Err(KeyError::Missing);
        assert_eq!(
            check_key(&missing, KeyRequirement::Required).map_err(|p| p.slug),
            Err("idempotency-key-missing")
        );
    }

    #[test]
    fn settings_are_checked_once() {
        let engine = || Engine::new(crate::MemoryStore::new());
        let build = |f: fn(ConfigBuilder) -> ConfigBuilder| f(ConfigBuilder::new(engine())).build();
        assert!(build(|b| b).is_ok());
        assert!(matches!(
            build(|b| b.lease(Duration::ZERO)),
            Err(ConfigError::TooShort { what: "lease", .. })
        ));
        assert!(matches!(
            build(|b| b.lease(Duration::from_micros(500))),
            Err(ConfigError::TooShort { what: "lease", .. })
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
        // A route's own ttl is checked against the configured lease when resolved.
        let config = ConfigBuilder::<Config>::new(engine())
            .lease(Duration::from_secs(300))
            .build()
            .expect("valid");
        let route = Route::new(
            "create_charge",
            Some(Duration::from_secs(60)),
            None,
            KeyRequirement::Required,
            false,
            None,
        );
        assert!(matches!(
            route.resolve(&config),
            Err(ConfigError::TtlShorterThanLease { .. })
        ));
        let fine = Route::new(
            "r",
            None,
            Some(Duration::from_secs(1)),
            KeyRequirement::Optional,
            true,
            Some(9),
        );
        let p = fine.resolve(&config).expect("valid");
        assert_eq!(p.policy.lease, Duration::from_secs(1));
        assert_eq!(p.policy.ttl, DEFAULT_TTL);
        assert_eq!(p.policy.route, "r");
        assert_eq!(p.max_response, 9);
        assert!(p.policy.store_server_errors);
    }
}
