//! The adapter glue's side of core: what `idempotent-axum`, `idempotent-actix` and the code
//! the `#[idempotent]` attributes generate call. Not a public API and not covered by semver:
//! any release may change it, which is why the adapters pin `idempotent-core` with `=`.
//!
//! - the request driver (`driver`): one request's life from its head to its answer,
//!   generic over an adapter's `driver::Glue`;
//! - what the driver is made of, as an adapter names it (`Route`, `Reply`, `Recorder`, …;
//!   `Capture` because a `Recorder` is made with one);
//! - function mode's runtime, as its expansion names it (`call`).

pub use crate::engine::detached::Detached;
pub use crate::http::capture::{Capture, Recorder};
pub use crate::http::reply::{FIRST_EXECUTION, Reply};
pub use crate::http::request::{RequestHead, is_safe_method};
pub use crate::http::route::{Route, RouteArgs, idempotent_context};

/// What each adapter re-exports at its root (`pub use idempotent_core::__private::exports::*;`),
/// so a user depends on one adapter crate and finds the core types there: one list for both.
pub mod exports {
    /// Idempotent functions (`#[idempotent(key_from = …)]`, queue consumers): the runner and
    /// its types.
    pub use crate::call;
    pub use crate::derive::{DeriveSecret, DerivedKey, Idempotent, SecretError};
    pub use crate::duration::{DurationError, parse_duration};
    pub use crate::engine::{DEFAULT_LEASE, DEFAULT_TTL, Drained, Engine, EngineBuilder};
    pub use crate::fingerprint::Fingerprint;
    pub use crate::http::{ConfigError, DEFAULT_MAX_REQUEST, DEFAULT_MAX_RESPONSE};
    pub use crate::key::{IdempotencyKey, KeyError};
    pub use crate::problem::Problem;
    pub use crate::scope::{Scope, ScopeError, ScopeValue};
    #[cfg(feature = "mysql")]
    #[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
    pub use crate::store::MySqlStore;
    #[cfg(feature = "postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    pub use crate::store::PostgresStore;
    #[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
    #[cfg_attr(
        docsrs,
        doc(cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql")))
    )]
    pub use crate::store::SetupError;
    #[cfg(feature = "sqlite")]
    #[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
    pub use crate::store::SqliteStore;
    pub use crate::store::{MemoryStore, Store, StoreError, Sweeper};
    #[cfg(feature = "redis")]
    #[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
    pub use crate::store::{RedisSetupError, RedisStore, RedisStoreBuilder};
    pub use crate::tx::{CommitPath, TxOptions};
    #[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
    #[cfg_attr(
        docsrs,
        doc(cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql")))
    )]
    pub use crate::tx::{Transaction, TxDatabase};
    #[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
    #[cfg_attr(
        docsrs,
        doc(cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql")))
    )]
    pub use ::sqlx;
}

/// The request driver the adapters share.
pub mod driver {
    pub use crate::http::driver::*;
}

/// Function mode's runtime.
pub mod call {
    pub use crate::call::{CallError, Calls, Function, FunctionArgs, Input};
    pub use crate::scope::ScopeValue;
    pub use ::core::time::Duration;

    /// An input of the function, for its fingerprint (type-checks it against [`Input`], so a
    /// parameter that is not `Serialize` gets `Input`'s message, at the parameter).
    pub fn input<T: Input>(value: &T) -> &dyn Input {
        value
    }

    /// The scope of a parameter (type-checks it against [`ScopeValue`]).
    pub fn scope_of<T: ScopeValue + ?Sized>(
        value: &T,
    ) -> Result<crate::scope::Scope, crate::scope::ScopeError> {
        value.to_scope()
    }

    /// The unscoped namespace.
    pub fn unscoped() -> Result<crate::scope::Scope, crate::scope::ScopeError> {
        Ok(crate::scope::Scope::unscoped())
    }
}

/// Defines an adapter's `Idempotency` (the configuration an application installs once) and
/// its `IdempotencyBuilder`: the same type, methods and docs for every adapter, written once.
/// `$krate` is the adapter's crate name (for the doc example), `install` how an application
/// installs it (`.layer(idempotency.layer())`), `drain` when to call `drain` on that framework.
#[macro_export]
#[doc(hidden)]
macro_rules! __idempotency_type {
    ($krate:ident, install = $install:literal, drain = $drain:literal) => {
        /// The runtime configuration of `#[idempotent]` handlers: the store (through its
        /// engine), the default ttl, the size limits and fail-open (the default lease, the
        /// derive secret and the sweeper are the engine's: [`Engine::builder`](crate::Engine::builder)).
        #[doc = concat!("Install it with ", $install, "; at shutdown, [`Idempotency::drain`] waits")]
        /// for executions still running (a client that went away does not stop them).
        ///
        /// ```
        /// use std::time::Duration;
        #[doc = concat!("use ", stringify!($krate), "::{Engine, Idempotency, MemoryStore};")]
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
        #[doc = concat!("# Ok::<(), ", stringify!($krate), "::ConfigError>(())")]
        /// ```
        #[derive(Clone)]
        pub struct Idempotency {
            pub(crate) config: ::std::sync::Arc<$crate::http::Config>,
        }

        /// Builds an [`Idempotency`]; unusable values (a zero or over-long duration, a ttl
        /// shorter than the lease, a zero size) are refused once by `build`, never per request.
        pub type IdempotencyBuilder = $crate::http::ConfigBuilder<Idempotency>;

        impl ::core::convert::From<$crate::http::Config> for Idempotency {
            fn from(config: $crate::http::Config) -> Self {
                Idempotency {
                    config: ::std::sync::Arc::new(config),
                }
            }
        }

        impl ::core::fmt::Debug for Idempotency {
            fn fmt(&self, f: &mut ::core::fmt::Formatter<'_>) -> ::core::fmt::Result {
                f.debug_struct("Idempotency")
                    .field("config", &self.config)
                    .finish()
            }
        }

        impl Idempotency {
            /// Configuration over `store` with the defaults: ttl 24 h, lease 30 s (the
            /// engine's), responses up to 1 MiB stored, request bodies up to 2 MiB, fail closed.
            pub fn new(store: impl $crate::Store) -> Self {
                Self::from_engine($crate::Engine::new(store))
            }

            /// Configuration with the defaults over an engine you built (to share one store
            /// between several apps, for example).
            pub fn from_engine(engine: $crate::Engine) -> Self {
                $crate::http::Config::new(engine).into()
            }

            /// Starts a configuration over `store` whose defaults you set.
            pub fn builder(store: impl $crate::Store) -> IdempotencyBuilder {
                $crate::http::ConfigBuilder::new($crate::Engine::new(store))
            }

            /// Starts a configuration over an engine you built.
            pub fn builder_from_engine(engine: $crate::Engine) -> IdempotencyBuilder {
                $crate::http::ConfigBuilder::new(engine)
            }

            /// The engine.
            pub fn engine(&self) -> &$crate::Engine {
                self.config.engine()
            }

            /// The settings.
            pub fn config(&self) -> &$crate::http::Config {
                &self.config
            }

            /// Waits, at most `timeout`, for executions still running, and starts no new ones
            /// (requests arriving meanwhile get a 503 problem with `Retry-After`). Executions
            /// still running at the bound are logged and stay in progress until their leases
            /// end.
            ///
            #[doc = $drain]
            pub async fn drain(&self, timeout: ::core::time::Duration) -> $crate::engine::Drained {
                self.engine().drain(timeout).await
            }
        }
    };
}
