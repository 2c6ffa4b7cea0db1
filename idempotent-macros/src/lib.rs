//! The `#[idempotent]` attribute. Use it through an adapter crate (`idempotent-axum`), which
//! re-exports it as `idempotent` with these docs; generated code reaches the runtime only
//! through that crate's `#[doc(hidden)] __private` module.
//!
//! Stages, one per file: `args` (typed arguments with spans) → `signature` (the handler's
//! shape and the names its parameters bind) → `validate` (a typed plan per mode, handler or
//! function, or every error) → `expand` (code generation: `handler`, `function`). Everything
//! below the entry points works on `proc_macro2`, so it unit-tests without a compiler run.
#![cfg_attr(docsrs, feature(doc_cfg))]
// The workspace denies unsafe code (one test allows it, to count allocations); the published
// crates forbid it outright.
#![forbid(unsafe_code)]

use proc_macro::TokenStream;

mod args;
mod expand;
#[cfg(test)]
mod golden;
mod signature;
mod validate;

use validate::Entry;

/// Makes an async handler safe to retry: claim → execute → store → replay per
/// (scope, `Idempotency-Key`).
///
/// ```
/// use axum::{Json, http::StatusCode};
/// use idempotent_axum::idempotent;
/// # use axum::{extract::FromRequestParts, http::request::Parts};
/// # struct Account(String);
/// # impl<S: Send + Sync> FromRequestParts<S> for Account {
/// #     type Rejection = StatusCode;
/// #     async fn from_request_parts(_: &mut Parts, _: &S) -> Result<Self, StatusCode> {
/// #         Ok(Account("acct_1".into()))
/// #     }
/// # }
///
/// #[idempotent(scope = "account", ttl = "24h")]
/// async fn create_charge(Account(account): Account, Json(amount): Json<u64>) -> (StatusCode, String) {
///     (StatusCode::CREATED, format!("charged {amount} to {account}"))
/// }
/// ```
///
/// # Arguments
///
/// | argument | meaning | default |
/// |---|---|---|
/// | `scope = "param"` / `"param.field"` | the caller: a binding of the handler's parameters (patterns such as `Account(id): Account` bind `id`) whose type implements `ScopeValue`; take it from your authentication's output | required, or `unscoped` |
/// | `unscoped` | every caller shares one namespace (say so explicitly) | |
/// | `ttl = "24h"` | how long a finished response is replayed (a floor) | the configuration's (24 h) |
/// | `lease = "30s"` | how long a crashed attempt blocks retries (heartbeat-extended while the handler runs) | the configuration's (30 s) |
/// | `key = "required"` / `"optional"` | whether requests without a key are refused (400) or run unprotected | `required` |
/// | `store_server_errors` | store and replay 5xx too (Stripe style) instead of releasing the key | off |
/// | `max_response = "1MiB"` | larger responses are sent but not stored; retries get a 410 problem | the configuration's (1 MiB) |
/// | `commit = "single"` / `"two"` | transactional handlers (a `Transaction<DB>` parameter): the claim inside the handler's transaction (one commit), or committed first | the configuration's (single) |
/// | `wait = "5s"` | how long a duplicate that finds the first attempt running waits for its answer (then replays it, or runs the handler if the first released the key: a 5xx, a panic) before 409; at most the lease (a longer literal pair is a compile error); woken by the store's change notifications | plain routes: the configuration's (zero: 409 at once); transactional: the configuration's `transaction_wait` (50 ms) |
/// | `extract_on_replay` | with an engine's replay cache, the handler's last extractor runs on every request, replays from the cache included (see "The replay cache" below): for a body extractor that also checks something, such as a webhook signature | off: a body extractor runs only when the cache misses |
/// | `crate = "path"` | where the adapter crate is, if renamed | `::idempotent_axum` |
/// | `key_from = "msg.id"`, `name = "…"` | make an idempotent *function* instead (function mode, see `idempotent_core::idempotent`); `name` without `key_from` is refused: a handler's records belong to its caller's scope and request, not to a name | |
///
/// A parameter whose type is `Transaction<DB>` (the adapter's, not sqlx's) makes the handler
/// transactional: it is no extractor; the runtime opens the transaction after the claim and
/// commits it with the stored response (see the adapter's docs).
///
/// A parameter whose type is `Idempotent` (or `&Idempotent`) receives the request's
/// idempotency context: `idem.derive("payment-provider")` is a key for a downstream call that
/// is the same on every run of this (scope, key), on every instance and after a restart, so a
/// re-run handler does not charge twice downstream. It is no extractor (an extractor cannot
/// see the scope); the engine must hold a derive secret (`Engine::builder(…).derive_secret(…)`), or the
/// route answers 500 and logs why. The attribute recognises the parameter by its type's last
/// path segment, `Idempotent` (as it does `Transaction`): a `use … as` rename or a type alias
/// hides it, and the parameter is then taken for an extractor (which it is not).
///
/// Durations are `<n>ms`, `<n>s`, `<n>m`, `<n>h` or `<n>d`, from 100 ms to 365 days; sizes are
/// `<n>` (bytes), `<n>KiB`, `<n>MiB` or `<n>GiB`. An argument written here overrides the
/// configuration's default for this route only.
///
/// # The replay cache
/// With an engine's replay cache (`Engine::builder(…).replay_cache(…)`), a retry of a
/// completed record the cache holds is answered before the handler's **last** extractor runs:
/// on Axum when it is a body extractor (`FromRequest`: `Json`, `Form`, `Bytes`, …; one that
/// reads only the request's parts, `FromRequestParts`, runs at once as always), on actix-web
/// when its type is named `Json`, `Form`, `Bytes` or `String`. Its body was accepted by that
/// extractor when the record was made, and the fingerprint still decides (another body is
/// 422). The scope's parameter is never deferred. A last extractor that does more than parse
/// (a webhook signature check over the body, a CSRF check) must run on every request: write
/// `extract_on_replay` on such a route.
///
/// # Checked at compile time
/// Unknown or duplicate arguments, malformed or out-of-bounds durations, zero sizes, a scope
/// that names no parameter (the error lists the parameters), two `Transaction` or two
/// `Idempotent` parameters,
/// sqlx's own `Transaction<'_, DB>`, `commit` without a transaction, a `wait` longer than the `lease`, `scope` together with `unscoped`
/// or neither, function mode's `name` or `store_errors` without `key_from`, a `ttl` shorter
/// than a `lease` written next to it, a function that is not
/// a free `async fn`, more extractors than axum takes beside the hidden context (15: axum's
/// limit is 16 arguments), a `#[cfg]` on the `Transaction` or `Idempotent` parameter (the
/// attribute provides them, so they exist in every configuration) and `#[idempotent(skip)]`
/// on a handler's parameter (a handler's fingerprint is its request, not its parameters). All errors are reported together, next to the unchanged function. A
/// `ttl` shorter than the *configured* lease can only be seen at run time: the route then
/// answers 500 and logs its name, once.
///
/// A scope whose type does not implement `ScopeValue` is refused too:
///
/// ```compile_fail
/// use axum::extract::Path;
/// use idempotent_axum::idempotent;
///
/// #[idempotent(scope = "ratio")]
/// async fn handler(Path(ratio): Path<f64>) {} // error: `f64` cannot be used as an idempotency scope
/// ```
///
/// Attributes on parameters are kept: `#[cfg]` and lint levels (`#[allow(unused_mut)] mut
/// tx: Transaction<…>`) hold as written, on the transaction and the context too (on the
/// bindings the expansion makes for them).
///
/// # Handler shapes and other attributes
/// Any handler axum accepts: `impl IntoResponse`, concrete types, `Result<T, E>` with any
/// `E: IntoResponse`, `Result<impl IntoResponse, E>`, state, path, query, header and custom
/// extractors, inner attributes such as `#![allow(..)]`. With other attribute macros, order
/// matters where they read the signature:
/// - `#[idempotent]` above `#[axum::debug_handler]` (debug_handler then checks the generated
///   handler); below it, debug_handler would check a signature that no longer exists.
/// - `#[tracing::instrument]` works above or below; below `#[idempotent]` it records the hidden
///   context (which shows method and path, never the key or body), so use `skip_all` or
///   `skip(..)` there as for any extractor that is not `Debug`.
///
/// The hidden context is one argument more than the handler was written with. So that it is
/// not what crosses clippy's `too_many_arguments` limit, a handler written with exactly its
/// default limit of seven arguments gets `#[allow(clippy::too_many_arguments)]`, unless its
/// own attributes already name that lint. (A lower `too-many-arguments-threshold` in
/// `clippy.toml` is not seen by the attribute: set the lint's level on such handlers yourself.)
///
/// # Equivalent code
/// The attribute keeps the function's name, visibility, attributes and body, and rewrites
/// its signature and body. This handler:
///
/// ```text
/// #[idempotent(scope = "account", ttl = "24h")]
/// async fn create_charge(Account(account): Account, Json(req): Json<NewCharge>) -> Result<Created, ApiError> {
///     /* body */
/// }
/// ```
///
/// becomes, in effect:
///
/// ```text
/// async fn create_charge(
///     ctx: idempotent_axum::__private::Context<true>, // key required
///     Account(account): Account,
///     Json(req): Json<NewCharge>,
/// ) -> axum::response::Response {
///     static ROUTE: Route = Route::new("create_charge", Some(Duration::from_millis(86_400_000)),
///                                      None, Key::Required, false, None);
///     let scope = scope_of(&account); // type-checked against `ScopeValue`
///     run(ctx, &ROUTE, scope, async move {
///         /* body, its output anchored to `Result<Created, ApiError>` */
///     }).await
/// }
/// ```
///
/// The hidden `Context` extractor runs before yours: it refuses a missing or malformed key
/// (400) and a body over the limit (413) before reading anything else, then reads the body for
/// the fingerprint and leaves it for your body extractor. Your extractors run next (a
/// rejection answers as usual, and nothing is claimed). `run` then computes the fingerprint
/// (method, the path as received, query, media type, body), claims the record and either
/// replays the stored response, answers a problem (409 in progress, 422 mismatch, 503 store
/// unavailable), or runs the body, detached from the connection so a client that goes away
/// does not stop it, and stores its response.
#[proc_macro_attribute]
pub fn idempotent_axum(args: TokenStream, item: TokenStream) -> TokenStream {
    expand::expand(args.into(), item.into(), Entry::Axum).into()
}

/// `#[idempotent(...)]` for Actix-web handlers, re-exported by `idempotent-actix` as
/// `idempotent`: the same attribute, arguments and checks as the Axum entry (see the
/// `idempotent-axum` docs), generating code that names only `::idempotent_actix::__private`
/// (or the `crate = "…"` path).
///
/// The hidden context is the handler's only extractor there and extracts the handler's own
/// parameters as one tuple, then binds each with its attributes. A tuple type has no place
/// for a `#[cfg]`, so a handler with `#[cfg]`-gated parameters is expanded once per
/// combination of them, each copy under the `#[cfg]` that selects it (at most 4 gated
/// parameters: 16 copies, of which the compiler keeps one).
///
/// ```
/// use actix_web::{HttpResponse, post, web};
/// use idempotent_actix::idempotent;
///
/// #[post("/v1/orders/{id}/refund")]
/// #[idempotent(unscoped, ttl = "1h")]
/// async fn refund(id: web::Path<u64>) -> HttpResponse {
///     HttpResponse::Created().body(format!("refunded {id}"))
/// }
/// ```
#[proc_macro_attribute]
pub fn idempotent_actix(args: TokenStream, item: TokenStream) -> TokenStream {
    expand::expand(args.into(), item.into(), Entry::Actix).into()
}

/// `#[idempotent(name = "book_payment", key_from = "msg.id", scope = "msg.tenant", ttl = "7d")]`
/// on an async function: **function mode**, re-exported by `idempotent-core` as `idempotent` (and reached
/// through each adapter's `idempotent` too, which switches to function mode on `key_from`).
///
/// ```
/// use idempotent_core::call::{CallError, Calls};
/// use idempotent_core::{Engine, MemoryStore, idempotent};
///
/// #[derive(serde::Serialize)]
/// struct PaymentEvent { id: String, tenant: String, amount: i64 }
///
/// #[idempotent(name = "book_payment", key_from = "msg.id", scope = "msg.tenant", ttl = "7d")]
/// async fn book_payment(calls: &Calls, msg: &PaymentEvent) -> Result<String, std::io::Error> {
///     Ok(format!("booked {}", msg.amount))
/// }
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let calls = Calls::new(Engine::new(MemoryStore::new()));
/// let msg = PaymentEvent { id: "evt_1".into(), tenant: "t1".into(), amount: 5 };
/// // Every redelivery gets the first run's output; the body runs once.
/// let first: Result<String, CallError<std::io::Error>> = book_payment(&calls, &msg).await;
/// assert_eq!(first.unwrap(), "booked 5");
/// assert_eq!(book_payment(&calls, &msg).await.unwrap(), "booked 5");
/// # }
/// ```
///
/// The function declares the runner it executes under, `calls: &Calls` (its callers pass
/// it), returns `Result<T, E>` with `T: Serialize + DeserializeOwned`, and becomes a function
/// returning `Result<T, CallError<E>>`.
///
/// # Arguments
///
/// | argument | meaning | default |
/// |---|---|---|
/// | `name = "book_payment"` | **the identity of the function's records**: see below | required |
/// | `key_from = "param"` / `"param.field"` | the key: a parameter (or a field of one) whose value is text, an integer or a UUID (a message id), taken as it is (no trimming, no unquoting: it is no header; 1 to 255 bytes, no NUL) | required |
/// | `scope = "param"` / `"param.field"` | the caller, as for handlers | required, or `unscoped` |
/// | `unscoped` | every caller shares one namespace | |
/// | `ttl = "7d"`, `lease = "30s"` | as for handlers | the runner's (24 h, 30 s) |
/// | `wait = "5s"` | a concurrent duplicate waits that long (at most the lease) for the first to finish and returns its output, instead of [`CallError::InProgress`] at once | the runner's (refuse at once) |
/// | `store_errors` | an `Err` whose `E: StoredError` says it is final is stored and returned on redelivery, instead of releasing the key | off |
/// | `crate = "path"` | where the crate is, if renamed | `::idempotent_core` (or the adapter whose attribute was written) |
///
/// **The name is the identity.** The function's records (and so its replays, and the keys
/// it derives downstream) belong to `name`, not to the function's module path or Rust name:
/// moving the function to another module or renaming it between a delivery and its
/// redelivery keeps its records, and the redelivery replays. Changing `name` starts new
/// records: a message the old name already handled runs again and derives new downstream
/// keys, so keep a name once messages have been handled under it. Two functions with one
/// name share records (give each its own). A name is 1 to 64 ASCII letters, digits, `_`,
/// `-` or `.` (`book_payment`, `billing.book-payment.v2`); it is also the `route` of the
/// function's logs and metrics. There is no default: a name taken from the module path
/// would change silently with a refactor.
///
/// - **every input is fingerprinted**, with the name: the JSON of each parameter (the
///   bindings of a destructured one), in order, so the same key with other arguments is
///   [`CallError::Mismatch`], never a replay, wherever the key comes from (`key_from = "id"`
///   with the message in another parameter as much as `key_from = "msg.id"`). Left out: the
///   runner, the transaction, the `Idempotent` context, the scope's parameter (they name the
///   record or are made by the runtime) and parameters marked `#[idempotent(skip)]`. A
///   function with one input is fingerprinted as that value's JSON, with several as an array
///   of them: adding, removing or reordering inputs changes the fingerprint, so a message
///   redelivered across such a change is a mismatch until its record expires;
/// - **an input must be `Serialize`**: a parameter that is no input of the operation (a
///   connection pool, an HTTP client, a counter) is marked `#[idempotent(skip)]`; otherwise
///   it is a compile error at that parameter, never a silent omission:
///
/// ```compile_fail
/// use idempotent_core::{call::Calls, idempotent};
///
/// struct Pool; // not `Serialize`
///
/// #[idempotent(name = "book", key_from = "id", unscoped)]
/// async fn book(calls: &Calls, id: &str, pool: &Pool) -> Result<(), std::io::Error> {
///     // error: `&Pool` does not implement `serde::Serialize`, so it cannot be part of the
///     //        idempotent function's fingerprint
///     Ok(())
/// }
/// ```
///
/// ```
/// use idempotent_core::{call::Calls, idempotent};
///
/// struct Pool; // no input of the operation
///
/// #[idempotent(name = "book", key_from = "id", unscoped)]
/// async fn book(calls: &Calls, id: &str, amount: i64, #[idempotent(skip)] pool: &Pool) -> Result<i64, std::io::Error> {
///     let _ = pool;
///     Ok(amount) // `id` and `amount` are fingerprinted: the same id with another amount is a mismatch
/// }
/// ```
///
/// - the key is the message id as it is (no trimming, no unquoting: it is no header);
/// - `Ok` is stored and returned on redelivery without running the body; `Err` releases the
///   key (retryable), unless `store_errors` is written and `E: StoredError` says it is final;
/// - a parameter `tx: Transaction<DB>` makes it transactional (the record commits with the
///   function's writes, in one commit); a parameter `idem: &Idempotent` gives the call's
///   context for derived downstream keys (the runner needs a derive secret).
///
/// Checked at compile time: `name` is written and valid, `key_from` and `scope` name
/// parameters (the error lists them), the runner is there, the return type is a `Result`,
/// every input is `Serialize`, parameter attributes are `#[idempotent(skip)]` only, and
/// HTTP-only arguments (`key`, `max_response`, `store_server_errors`, `commit`) are refused.
/// Other attributes on parameters (`#[cfg]`, lint levels) are kept; a `#[cfg]`-gated input
/// is fingerprinted where it exists.
///
/// [`CallError::Mismatch`]: ../idempotent_core/call/enum.CallError.html
/// [`CallError::InProgress`]: ../idempotent_core/call/enum.CallError.html
#[proc_macro_attribute]
pub fn idempotent_fn(args: TokenStream, item: TokenStream) -> TokenStream {
    expand::expand(args.into(), item.into(), Entry::Core).into()
}
