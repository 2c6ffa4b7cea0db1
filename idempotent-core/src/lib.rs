//! The core of `idempotent`: keys, scopes, fingerprints, records, the [`Store`] trait with its
//! stores, and the [`Engine`] that runs a handler at most once per (scope, key).
//!
//! Web applications use an adapter crate (`idempotent-axum`, `idempotent-actix`) that wraps
//! this crate; use it directly for queue consumers or any other async work.
//!
//! ```
//! use idempotent_core::*;
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let engine = Engine::new(MemoryStore::new());
//! let request = || ExecuteRequest {
//!     scope: Scope::new("acct_1").unwrap(),
//!     key: IdempotencyKey::parse(br#""order-42""#),
//!     fingerprint: Fingerprint::compute(&FingerprintInput {
//!         method: "POST", path: "/orders", query: None,
//!         content_type: Some("application/json"), body: br#"{"sku":"A1"}"#,
//!     }),
//! };
//! let mut runs = 0;
//! for _ in 0..3 {
//!     let out = engine.execute(request(), &Policy::default(), || async {
//!         runs += 1;
//!         Handled { value: (), record: StoredResponse::new(201, "ord_1").into() }
//!     }).await;
//!     assert!(matches!(out, Outcome::Executed { .. } | Outcome::Replayed(_)));
//! }
//! assert_eq!(runs, 1);
//! # }
//! ```
//!
//! # Life of a record
//! `claim` (atomic) → `in_progress` (lease, heartbeat-extended) → `complete` (fenced by the
//! lease token) → `done`, replayed until its ttl passes. 5xx and panics `release` the record
//! instead, so a retry runs again. A started execution is never abandoned because its caller
//! went away: the adapters run it in a [`Detached`] future, and [`Engine::drain`] waits for
//! the running ones at shutdown. See [`Store`] for what each store promises.
//!
//! [`call`] runs any async function the same way, for queue consumers: the output is stored
//! and returned on redelivery;
//! `#[idempotent(name = "book_payment", key_from = "msg.id", scope = "msg.tenant")]`
//! ([`idempotent`]) writes that for a function, whose records belong to its stable `name`.
//!
//! The [`http`] module holds what the HTTP adapters share (header rules, capture, replays,
//! problems, route settings) on plain types.
//!
//! # Features
//! - `sqlite`, `postgres`: the SQL stores (sqlx).
//!
//! The client side, a retry middleware for reqwest that makes one `Idempotency-Key` per
//! logical request, is its own crate, `idempotent-client` (it needs none of this one).
#![cfg_attr(docsrs, feature(doc_cfg))]
// The workspace denies unsafe code (one test allows it, to count allocations); the published
// crates forbid it outright.
#![forbid(unsafe_code)]

pub mod call;
mod clock;
mod derive;
mod duration;
mod engine;
mod fingerprint;
pub mod http;
mod jcs;
mod key;
pub mod observe;
mod problem;
mod scope;
mod store;
pub mod tx;

pub use clock::{Clock, ManualClock, SkewedClock, SystemClock};
pub use derive::{DeriveSecret, DerivedKey, Idempotent, SecretError};
pub use duration::{DurationError, format_duration, parse_duration};
pub use engine::{
    Begin, ConfigError, DEFAULT_LEASE, DEFAULT_TTL, Detached, Drained, Engine, ExecuteRequest,
    Execution, Handled, KeyRequirement, MAX_DURATION, MIN_DURATION, Outcome, PanicPayload, Policy,
    Recorded, Unprotected,
};
pub use fingerprint::{BodyKind, Fingerprint, FingerprintInput, canonical_form, canonical_json};
pub use key::{IdempotencyKey, KeyError, MAX_KEY_LEN};
pub use problem::{PROBLEM_BASE, Problem};
pub use scope::{Scope, ScopeError, ScopeValue};
#[cfg(any(feature = "sqlite", feature = "postgres"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "sqlite", feature = "postgres"))))]
pub use sqlx;
pub use store::memory::{MemoryStore, MemoryStoreBuilder};
pub use store::record::{
    Lease, LeaseToken, Record, RecordKey, RecordState, StoredOutcome, StoredResponse,
    retry_after_secs,
};
#[cfg(any(feature = "sqlite", feature = "postgres"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "sqlite", feature = "postgres"))))]
pub use store::sql::SetupError;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use store::sql::postgres::{PostgresStore, PostgresStoreBuilder};
#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
pub use store::sql::sqlite::{DEFAULT_BUSY_TIMEOUT, SqliteStore, SqliteStoreBuilder};
pub use store::sweeper::Sweeper;
pub use store::{ClaimOutcome, ClaimRequest, Deleted, Store, StoreError};
pub use tx::{CommitPath, TxOptions};
#[cfg(any(feature = "sqlite", feature = "postgres"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "sqlite", feature = "postgres"))))]
pub use tx::{Transaction, TxBegin, TxDatabase, TxExecution, TxFinished};
pub use uuid;

/// `#[idempotent(name = "book_payment", key_from = "msg.id", scope = "msg.tenant")]` on an
/// async function: the function runs once per (scope, key) until it succeeds, under the
/// [`call::Calls`] its callers pass, and its output is returned again on redelivery. `name`
/// (required) is the identity of its records: see [`call`] and the attribute's docs.
pub use idempotent_macros::idempotent_fn as idempotent;

#[doc(hidden)]
/// Not a stable API: the code `#[idempotent(key_from = …)]` generates calls these.
pub mod __private {
    /// Function mode's runtime.
    pub mod call {
        pub use crate::call::{CallError, Calls, Function};
        pub use crate::scope::ScopeValue;
        pub use ::core::time::Duration;

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
}
