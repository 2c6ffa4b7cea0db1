//! Actix-web adapter of `idempotent`: safe retries for POST handlers with one attribute.
//!
//! ```
//! use actix_web::{App, HttpResponse, post, web, dev::Payload, FromRequest, HttpRequest};
//! use idempotent_actix::{Idempotency, MemoryStore, idempotent};
//! use std::future::{Ready, ready};
//!
//! /// The authenticated caller: your auth's output, never a value the client picks.
//! struct Account(String);
//!
//! impl FromRequest for Account {
//!     type Error = actix_web::Error;
//!     type Future = Ready<Result<Self, Self::Error>>;
//!     fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
//!         // (verify the token here; this sketch trusts it)
//!         ready(req.headers().get("authorization")
//!             .and_then(|v| v.to_str().ok()?.strip_prefix("Bearer ").map(str::to_owned))
//!             .map(Account)
//!             .ok_or_else(|| actix_web::error::ErrorUnauthorized("no bearer")))
//!     }
//! }
//!
//! #[post("/v1/charges")]
//! #[idempotent(scope = "account_id", ttl = "24h")]
//! async fn create_charge(Account(account_id): Account, amount: web::Json<u64>) -> HttpResponse {
//!     HttpResponse::Created().body(format!("charged {} to {account_id}", amount.into_inner()))
//! }
//!
//! let idempotency = Idempotency::new(MemoryStore::new());
//! let app = App::new().wrap(idempotency.middleware()).service(create_charge);
//! # let _ = app;
//! ```
//!
//! Wiring is one line: `.wrap(idempotency.middleware())`. The middleware installs the
//! configuration ([`Idempotency`]: store, default ttl and lease, size limits); each
//! `#[idempotent]` handler then checks the key, reads the body for the fingerprint (handing
//! the same bytes on to `web::Json`, `web::Form` or `Bytes`, whose own limits keep working),
//! claims the record and runs, replays or refuses. A body with a `Content-Encoding` is
//! fingerprinted decoded, with the decoders actix-web's extractors use, and the size limit on
//! the decoded bytes: decoding stops there, so a small body that would expand enormously is a
//! 413 (features `compress-gzip`, `compress-brotli`, `compress-zstd`, on by default; they do
//! not switch on actix-web's own, which decide what your extractors decode). On an actix arbiter (the workers of an
//! `HttpServer` under `#[actix_web::main]`, `#[actix_web::test]`) the execution is polled in the
//! request's future until it first has to wait, and from there runs as a task of its own on
//! the worker's runtime; elsewhere it is such a task from the start. Either way a client that
//! goes away does not stop it. At shutdown, build the
//! server with `.disable_signals()` and call [`Idempotency::stop_server`] from your signal
//! handler: it stops accepting, drains, then stops the workers. (Actix's own stop drops the
//! workers' runtimes with any execution still on them, so draining after it is too late.)
//!
//! Handlers run as tasks of actix's runtime: drive them through an `HttpServer`, or in tests
//! with `#[actix_web::test]` / `actix_web::test::init_service` (which run inside it), not from
//! a plain `#[tokio::test]`. A handler can take up to 16 parameters, as in actix (the attribute
//! passes them to actix as one tuple, behind the idempotency checks).
//!
//! # The scope is the authenticated caller
//! `scope = "…"` names the parameter that identifies the caller, and a record belongs to
//! (scope, key): take it from your authentication extractor's output, as above. Never from a
//! value the client chooses freely (a path segment or body field nobody checked): a client
//! could then name another account's scope and replay its stored responses.
//!
//! # Exactly-once local writes: transactional mode
//! A handler that takes a `idempotent_actix::Transaction<DB>` parameter (features `sqlite` /
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
//! use actix_web::{App, HttpResponse, post, web};
//! use idempotent_actix::{DeriveSecret, Engine, Idempotency, Idempotent, MemoryStore, idempotent};
//! # use actix_web::{FromRequest, HttpRequest, dev::Payload};
//! # struct Account(String);
//! # impl FromRequest for Account {
//! #     type Error = actix_web::Error;
//! #     type Future = std::future::Ready<Result<Self, Self::Error>>;
//! #     fn from_request(_: &HttpRequest, _: &mut Payload) -> Self::Future {
//! #         std::future::ready(Ok(Account("acct_1".into())))
//! #     }
//! # }
//! # async fn provider_charge(_amount: u64, _idempotency_key: &str) -> Result<String, String> {
//! #     Ok("py_1".into())
//! # }
//!
//! #[post("/v1/charges")]
//! #[idempotent(scope = "account_id")]
//! async fn create_charge(
//!     Account(account_id): Account,
//!     idem: Idempotent,
//!     amount: web::Json<u64>,
//! ) -> HttpResponse {
//!     // The provider deduplicates by this key: a re-run of this handler charges once.
//!     let key = idem.derive("payment-provider").to_string();
//!     match provider_charge(amount.into_inner(), &key).await {
//!         Ok(payment) => HttpResponse::Created().body(format!("{account_id}: {payment}")),
//!         // A 5xx releases the key: the client's retry runs this again, under the same key.
//!         Err(_) => HttpResponse::BadGateway().body("provider unavailable"),
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
//! let app = App::new().wrap(idempotency.middleware()).service(create_charge);
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
//! generates; it is the same attribute as the Axum adapter's, with the same arguments and
//! semantics. With actix's route macros, either order works: `#[post("/x")]` above
//! `#[idempotent(..)]` or below it. Plain functions work with
//! `web::resource("/x").route(web::post().to(handler))`.
//!
//! # Responses
//! The same bytes as the Axum adapter for everything the library produces: a first execution
//! carries `Idempotent-Replayed: false`; a replay the stored status, headers and body with
//! `Idempotent-Replayed: true`; failures are `application/problem+json` (RFC 9457) with
//! `Cache-Control: no-store`: 400 missing/invalid key or unreadable body, 409 in progress (with
//! `Retry-After`), 410 the original response was not stored, 413 body over the limit, 422 key
//! reused for another request, 503 store unavailable (with `Retry-After`). GET, HEAD and
//! OPTIONS ignore the key and run the handler.
#![cfg_attr(docsrs, feature(doc_cfg))]
// The workspace denies unsafe code (one test allows it, to count allocations); the published
// crates forbid it outright.
#![forbid(unsafe_code)]

mod config;
mod middleware;
mod private;
mod response;

// The core types a user names, from one list both adapters share.
#[doc(inline)]
pub use idempotent_core::__private::exports::*;

pub use config::{Idempotency, IdempotencyBuilder};
pub use middleware::{IdempotencyMiddleware, IdempotencyService};
pub use response::{ProblemError, problem};

#[doc(inline)]
pub use idempotent_macros::idempotent_actix as idempotent;

#[doc(hidden)]
/// Not a stable API: the code `#[idempotent]` generates calls these.
pub mod __private {
    pub use crate::private::*;
    pub use idempotent_core::__private::call;
}
