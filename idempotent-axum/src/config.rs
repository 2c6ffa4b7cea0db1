//! The configuration an application installs once: [`Idempotency`].

use idempotent_core::http::{Config, ConfigBuilder};
use idempotent_core::{Engine, Store, engine::Drained};
use std::sync::Arc;
use std::time::Duration;

/// The runtime configuration of `#[idempotent]` routes: the store (through its engine), the
/// default ttl, the size limits and fail-open (the default lease and the derive secret are the
/// engine's: [`Engine::builder`]). Install it with
/// `.layer(idempotency.layer())`; at shutdown, [`Idempotency::drain`] waits for executions
/// still running (a client that went away does not stop them).
///
/// ```
/// use std::time::Duration;
/// use idempotent_axum::{Engine, Idempotency, MemoryStore};
///
/// // HTTP settings on the configuration:
/// let idempotency = Idempotency::builder(MemoryStore::new())
///     .ttl(Duration::from_secs(3600))
///     .build()?;
/// // Engine-wide ones (the default lease, the derive secret) on the engine it is built over:
/// let engine = Engine::builder(MemoryStore::new()).lease(Duration::from_secs(10)).build()?;
/// let idempotency = Idempotency::builder_from_engine(engine)
///     .ttl(Duration::from_secs(3600))
///     .build()?;
/// # let _ = idempotency;
/// # Ok::<(), idempotent_axum::ConfigError>(())
/// ```
#[derive(Clone)]
pub struct Idempotency {
    pub(crate) config: Arc<Config>,
}

/// Builds an [`Idempotency`]; unusable values (a zero or over-long duration, a ttl shorter
/// than the lease, a zero size) are refused once by `build`, never per request.
pub type IdempotencyBuilder = ConfigBuilder<Idempotency>;

impl From<Config> for Idempotency {
    fn from(config: Config) -> Self {
        Idempotency {
            config: Arc::new(config),
        }
    }
}

impl std::fmt::Debug for Idempotency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idempotency")
            .field("config", &self.config)
            .finish()
    }
}

impl Idempotency {
    /// Configuration over `store` with the defaults: ttl 24 h, lease 30 s (the engine's), responses up to
    /// 1 MiB stored, request bodies up to 2 MiB, fail closed.
    pub fn new(store: impl Store) -> Self {
        Self::from_engine(Engine::new(store))
    }

    /// Configuration with the defaults over an engine you built (to share one store between
    /// several routers, for example).
    pub fn from_engine(engine: Engine) -> Self {
        Config::new(engine).into()
    }

    /// Starts a configuration over `store` whose defaults you set.
    pub fn builder(store: impl Store) -> IdempotencyBuilder {
        ConfigBuilder::new(Engine::new(store))
    }

    /// Starts a configuration over an engine you built.
    pub fn builder_from_engine(engine: Engine) -> IdempotencyBuilder {
        ConfigBuilder::new(engine)
    }

    /// The engine.
    pub fn engine(&self) -> &Engine {
        self.config.engine()
    }

    /// The settings.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Waits, at most `timeout`, for executions still running, and starts no new ones (requests
    /// arriving meanwhile get a 503 problem with `Retry-After`). Call it after the server
    /// stopped accepting connections (after `axum::serve(..).with_graceful_shutdown(..)`
    /// returned): a handler whose client went away keeps running after its connection closed,
    /// and this lets it store its response before the process exits. Executions still running
    /// at the bound are logged and stay in progress until their leases end.
    pub async fn drain(&self, timeout: Duration) -> Drained {
        self.engine().drain(timeout).await
    }
}
