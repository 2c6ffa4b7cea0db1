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
//! claims the record and runs, replays or refuses. The fingerprint covers the body as this
//! layer receives it: for compressed request bodies, add tower-http's
//! `RequestDecompressionLayer` outside it (after it, in `.layer` order), so a retry whose
//! compressor wrote other bytes for the same content still matches. At shutdown, call
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
//! # Calls to other systems: derived keys
//! The seed's rule: "pass a key downstream whenever the provider supports one, and derive it
//! from your own key." A handler that takes an [`Idempotent`] parameter (filled by the
//! attribute, not an extractor: only the attribute sees the scope) asks it for
//! `idem.derive("payment-provider")`: a key that is the same on every run of this (scope,
//! key), on every instance and after a restart, and reveals neither (an HMAC-SHA-256 under
//! your [`DeriveSecret`], shown as a UUID). When the handler is killed after the provider
//! charged the card, the retry runs it again and the provider, seeing the same key, returns
//! the first charge instead of making a second.
//!
//! ```
//! use axum::{Json, Router, routing::post, http::StatusCode};
//! use idempotent_axum::{DeriveSecret, Engine, Idempotency, Idempotent, MemoryStore, idempotent};
//! # use axum::{extract::FromRequestParts, http::request::Parts};
//! # struct Account(String);
//! # impl<S: Send + Sync> FromRequestParts<S> for Account {
//! #     type Rejection = StatusCode;
//! #     async fn from_request_parts(_: &mut Parts, _: &S) -> Result<Self, StatusCode> {
//! #         Ok(Account("acct_1".into()))
//! #     }
//! # }
//! # struct Provider;
//! # impl Provider {
//! #     async fn charge(&self, _amount: u64, _idempotency_key: &str) -> Result<String, String> {
//! #         Ok("py_1".into())
//! #     }
//! # }
//! # static PROVIDER: Provider = Provider;
//!
//! #[idempotent(scope = "account_id")]
//! async fn create_charge(
//!     Account(account_id): Account,
//!     idem: Idempotent,
//!     Json(amount): Json<u64>,
//! ) -> (StatusCode, String) {
//!     // The provider deduplicates by this key: a re-run of this handler charges once.
//!     let key = idem.derive("payment-provider").to_string();
//!     match PROVIDER.charge(amount, &key).await {
//!         Ok(payment) => (StatusCode::CREATED, format!("{account_id}: {payment}")),
//!         // A 5xx releases the key: the client's retry runs this again, under the same key.
//!         Err(_) => (StatusCode::BAD_GATEWAY, "provider unavailable".into()),
//!     }
//! }
//!
//! // The secret: the same on every instance and across restarts (your secret manager).
//! let secret = std::env::var("IDEMPOTENCY_SECRET")
//!     .unwrap_or_else(|_| "a doctest-only secret of at least 32 bytes".into());
//! let engine = Engine::builder(MemoryStore::new())
//!     .derive_secret(DeriveSecret::new(secret)?)
//!     .build()?;
//! let idempotency = Idempotency::builder_from_engine(engine).build()?;
//! let app: Router = Router::new()
//!     .route("/v1/charges", post(create_charge))
//!     .layer(idempotency.layer());
//! # let _ = app;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! The engine must hold the secret (`Engine::builder(…).derive_secret(…)`, one secret for the
//! handlers and the idempotent functions of a process); there is no default, because a
//! secret made up at start-up would give another key after a restart, which is a double
//! charge downstream. Without one, a handler that takes `Idempotent` is never run: its
//! requests get a 500 and the log says why. Rotation is described at [`DeriveSecret`]. A
//! request that runs without a key (a safe method, or no key where it is optional) is an
//! operation of its own, and its derived keys are random.
//!
//! # The attribute
//! With `key_from = "msg.id"` it makes an idempotent *function* instead of a handler (a queue
//! consumer's, say), which must carry a stable `name = "…"`: the identity of its records and
//! derived keys, kept when the function moves or is renamed (see `idempotent_core::call`). See [`idempotent`] for its arguments, what it checks at compile time and the code it
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
#![cfg_attr(docsrs, feature(doc_cfg))]
// The workspace denies unsafe code (one test allows it, to count allocations); the published
// crates forbid it outright.
#![forbid(unsafe_code)]

mod config;
mod layer;
mod private;
mod response;

// The core types a user names, from one list both adapters share.
#[doc(inline)]
pub use idempotent_core::__private::exports::*;

pub use config::{Idempotency, IdempotencyBuilder};
pub use layer::{IdempotencyLayer, IdempotencyService};
pub use response::problem;

#[doc(inline)]
pub use idempotent_macros::idempotent_axum as idempotent;

#[doc(hidden)]
/// Not a stable API: the code `#[idempotent]` generates calls these.
pub mod __private {
    pub use crate::private::*;
    pub use idempotent_core::__private::call;
}
