//! Axum adapter of `idempotent`: safe retries for POST handlers with one attribute.
//!
//! ```
//! use axum::{Json, Router, routing::post, http::StatusCode};
//! use axum::extract::FromRequestParts;
//! use axum::http::request::Parts;
//! use idempotent_axum::{Idempotency, MemoryStore, idempotent};
//!
//! /// The authenticated caller: your auth layer's output, never a value the client picks.
//! struct Account(String);
//!
//! impl<S: Send + Sync> FromRequestParts<S> for Account {
//!     type Rejection = StatusCode;
//!     async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, StatusCode> {
//!         // (verify the token here; this sketch trusts it)
//!         parts.headers.get("authorization")
//!             .and_then(|v| v.to_str().ok()?.strip_prefix("Bearer ").map(str::to_owned))
//!             .map(Account)
//!             .ok_or(StatusCode::UNAUTHORIZED)
//!     }
//! }
//!
//! #[idempotent(scope = "account_id", ttl = "24h")]
//! async fn create_charge(Account(account_id): Account, Json(amount): Json<u64>) -> (StatusCode, String) {
//!     (StatusCode::CREATED, format!("charged {amount} to {account_id}"))
//! }
//!
//! let idempotency = Idempotency::new(MemoryStore::new());
//! let app: Router = Router::new()
//!     .route("/v1/charges", post(create_charge))
//!     .layer(idempotency.layer());
//! # let _ = app;
//! ```
//!
//! Wiring is one line: `.layer(idempotency.layer())`. The layer installs the configuration
//! ([`Idempotency`]: store, default ttl and lease, size limits); each `#[idempotent]` handler
//! then checks the key, reads the body for the fingerprint (leaving it for your extractors),
//! claims the record and runs, replays or refuses. At shutdown, call
//! [`Idempotency::drain`] after the server stops: handlers whose clients went away keep
//! running and store their responses.
//!
//! # The scope is the authenticated caller
//! `scope = "…"` names the parameter that identifies the caller, and a record belongs to
//! (scope, key): take it from your authentication extractor's output, as above. Never from a
//! value the client chooses freely (a path segment or body field nobody checked): a client
//! could then name another account's scope and replay its stored responses.
//!
//! # Exactly-once local writes: transactional mode
//! A handler that takes a `idempotent_axum::Transaction<DB>` parameter (features `sqlite` /
//! `postgres`; `DB` is `sqlx::Sqlite` or `sqlx::Postgres`, the store's own database) writes
//! through that transaction, and its stored response commits **with** those writes, in one
//! commit, or not at all: a 5xx, 408/409/425/429, a panic, a killed connection or a crash
//! rolls both back, and the response is sent only after COMMIT succeeded. Calls to other
//! systems are not covered (give them keys derived from the request's). The attribute's
//! `commit = "single" | "two"` and `wait = "5s"` tune it; a store on another database is
//! refused with a logged error and a 500. See `idempotent_core::tx` for the two commit paths.
//!
//! # The attribute
//! See [`idempotent`] for its arguments, what it checks at compile time and the code it
//! generates.
//!
//! # Responses
//! A first execution returns the handler's response with `Idempotent-Replayed: false`; a
//! retry of a finished request returns the stored status, headers and body with
//! `Idempotent-Replayed: true`. Failures are `application/problem+json` (RFC 9457) with
//! `Cache-Control: no-store`: 400 missing/invalid key or unreadable body, 409 in progress
//! (with `Retry-After`), 410 the original response was too large to store, 413 body over the
//! limit, 422 key reused for another request, 503 store unavailable (with `Retry-After`). GET,
//! HEAD and OPTIONS ignore the key and run the handler.

mod config;
mod layer;
mod private;
mod response;

#[cfg(feature = "postgres")]
pub use idempotent_core::PostgresStore;
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub use idempotent_core::SetupError;
#[cfg(feature = "sqlite")]
pub use idempotent_core::SqliteStore;
pub use idempotent_core::http::{ConfigError, DEFAULT_MAX_REQUEST, DEFAULT_MAX_RESPONSE};
pub use idempotent_core::{CommitPath, TxOptions};
pub use idempotent_core::{
    DEFAULT_LEASE, DEFAULT_TTL, DeriveSecret, DerivedKey, Drained, DurationError, Engine,
    Fingerprint, IdempotencyKey, Idempotent, KeyError, MemoryStore, Problem, Scope, ScopeError,
    ScopeValue, SecretError, Store, StoreError, Sweeper, parse_duration,
};
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub use idempotent_core::{Transaction, TxDatabase, sqlx};

pub use config::{Idempotency, IdempotencyBuilder};
pub use layer::{IdempotencyLayer, IdempotencyService};
pub use response::problem;

#[doc(inline)]
pub use idempotent_macros::idempotent_axum as idempotent;

#[doc(hidden)]
/// Not a stable API: the code `#[idempotent]` generates calls these.
pub mod __private {
    pub use crate::private::*;
}
