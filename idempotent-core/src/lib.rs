//! The core of `idempotent`: keys, scopes, fingerprints, records, the [`Store`] trait with its
//! stores, and the [`Engine`] that runs a handler at most once per (scope, key).
//!
//! Web applications use an adapter crate (`idempotent-axum`, `idempotent-actix`) that wraps
//! this crate; use it directly for queue consumers or any other async work.
//!
//! ```
//! use idempotent_core::engine::{Begin, ExecuteRequest, Policy};
//! use idempotent_core::fingerprint::{Fingerprint, FingerprintInput};
//! use idempotent_core::store::StoredResponse;
//! use idempotent_core::{Engine, IdempotencyKey, MemoryStore, Scope};
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
//!     match engine.begin(request(), &Policy::default()).await {
//!         Begin::Claimed(mut execution) => {
//!             let work = async {
//!                 runs += 1;
//!                 StoredResponse::new(201, "ord_1")
//!             };
//!             let response = execution.run(work).await.unwrap();
//!             execution.finish(response.into()).await;
//!         }
//!         Begin::Replay(_stored) => {} // answer with the stored response
//!         other => panic!("{other:?}"),
//!     }
//! }
//! assert_eq!(runs, 1);
//! # }
//! ```
//!
//! # Life of a record
//! `claim` (atomic) → `in_progress` (lease, heartbeat-extended) → `complete` (fenced by the
//! lease token) → `done`, replayed until its ttl passes. 5xx and panics `release` the record
//! instead, so a retry runs again. A started execution is never abandoned because its caller
//! went away: the adapters run it in a detached future, and [`Engine::drain`] waits for
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
//! - `sqlite`, `postgres`, `mysql`: the SQL stores (sqlx; `mysql` serves MySQL and MariaDB).
//! - `redis`: the Redis store, standalone and Redis Cluster ([`store::RedisStore`]).
//!
//! The client side, a retry middleware for reqwest that makes one `Idempotency-Key` per
//! logical request, is its own crate, `idempotent-client` (it needs none of this one).
#![cfg_attr(docsrs, feature(doc_cfg))]
// The workspace denies unsafe code (one test allows it, to count allocations); the published
// crates forbid it outright.
#![forbid(unsafe_code)]

pub mod call;
pub mod clock;
mod derive;
mod duration;
pub mod engine;
pub mod fingerprint;
mod form;
pub mod http;
mod jcs;
mod key;
pub mod observe;
mod problem;
mod scope;
pub mod store;
pub mod tx;

// The root holds what a user names; everything else is in its module above. A new export
// here is a visible change to `tests/public-api/idempotent-core.txt`.
pub use derive::{DeriveSecret, DerivedKey, Idempotent, SecretError};
pub use duration::{DurationError, parse_duration};
pub use engine::{ConfigError, Engine};
pub use key::{IdempotencyKey, KeyError};
pub use problem::Problem;
pub use scope::{Scope, ScopeError, ScopeValue};
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
#[cfg_attr(
    docsrs,
    doc(cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql")))
)]
pub use sqlx;
pub use store::MemoryStore;
#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub use store::MySqlStore;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use store::PostgresStore;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use store::RedisStore;
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
#[cfg_attr(
    docsrs,
    doc(cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql")))
)]
pub use store::SetupError;
#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
pub use store::SqliteStore;
pub use store::{Store, StoreError};
pub use tx::CommitPath;
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
#[cfg_attr(
    docsrs,
    doc(cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql")))
)]
pub use tx::Transaction;
pub use uuid;

/// `#[idempotent(name = "book_payment", key_from = "msg.id", scope = "msg.tenant")]` on an
/// async function: the function runs once per (scope, key) until it succeeds, under the
/// [`call::Calls`] its callers pass, and its output is returned again on redelivery. `name`
/// (required) is the identity of its records: see [`call`] and the attribute's docs.
pub use idempotent_macros::idempotent_fn as idempotent;

/// What only the adapters and the attributes' expansions use: **not a public API, not covered
/// by semver** (the adapters pin this crate with `=` for that reason). Hidden from the docs.
#[doc(hidden)]
#[path = "adapter.rs"]
pub mod __private;
