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
