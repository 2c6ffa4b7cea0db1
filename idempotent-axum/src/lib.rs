//! Axum adapter of `idempotent`: safe retries for POST handlers with one attribute.
//!
//! ```
//! use axum::{Json, Router, routing::post, http::StatusCode, extract::Path};
//! use idempotent_axum::{Idempotency, MemoryStore, idempotent};
//!
//! #[idempotent(scope = "account_id", ttl = "24h")]
//! async fn create_charge(Path(account_id): Path<String>, Json(amount): Json<u64>) -> (StatusCode, String) {
//!     (StatusCode::CREATED, format!("charged {amount} to {account_id}"))
//! }
//!
//! let idempotency = Idempotency::new(MemoryStore::new());
//! let app: Router = Router::new()
//!     .route("/accounts/{account_id}/charges", post(create_charge))
//!     .layer(idempotency.layer());
//! # let _ = app;
//! ```
//!
//! Wiring is one line: `.layer(idempotency.layer())`. The layer installs the configuration
//! (store, default ttl and lease, size limits) and buffers the bodies of unsafe requests so
//! they can be fingerprinted and still reach your body extractor. Put it on the idempotent
//! routes (or the whole router: other handlers just receive a buffered body).
//!
//! # The attribute's arguments
//!
//! | argument | meaning | default |
//! |---|---|---|
//! | `scope = "param"` / `"param.field"` | the caller: a binding of the handler's parameters whose type implements [`ScopeValue`] | required (or `unscoped`) |
//! | `unscoped` | every caller shares one namespace (say so explicitly) | |
//! | `ttl = "24h"` | how long a finished response is replayed | [`Idempotency::ttl`] (24 h) |
//! | `lease = "30s"` | how long a crashed attempt blocks retries | [`Idempotency::lease`] (30 s) |
//! | `key = "required"` / `"optional"` | whether requests without a key are refused (400) or run unprotected | `required` |
//! | `store_server_errors` | store and replay 5xx too (Stripe style) instead of releasing the key | off |
//! | `max_response = "1MiB"` | larger responses are not stored; retries get a 410 problem | [`Idempotency::max_response`] (1 MiB) |
//! | `crate = "path"` | where this crate is, if renamed | `::idempotent_axum` |
//!
//! Durations are `<n>ms`, `<n>s`, `<n>m`, `<n>h` or `<n>d`; sizes `<n>`, `<n>KiB`, `<n>MiB`.
//!
//! The scope's type must implement [`ScopeValue`] (strings, integers, UUIDs, your own id
//! types); anything else is refused at compile time with a message saying so:
//!
//! ```compile_fail
//! use axum::extract::Path;
//! use idempotent_axum::idempotent;
//!
//! #[idempotent(scope = "ratio")]
//! async fn handler(Path(ratio): Path<f64>) {} // error: `f64` cannot be used as an idempotency scope
//! ```
//!
//! # Responses
//! A first execution returns the handler's response with `Idempotent-Replayed: false`; a
//! retry of a finished request returns the stored status, headers and body with
//! `Idempotent-Replayed: true`. Failures are `application/problem+json` (RFC 9457) with
//! `Cache-Control: no-store`: 400 missing/invalid key, 409 in progress (with `Retry-After`),
//! 422 key reused for another request, 503 store unavailable (with `Retry-After`). GET, HEAD
//! and OPTIONS ignore the key and run the handler.

use axum::body::{Body, Bytes};
use axum::extract::{FromRequestParts, MatchedPath, Request};
use axum::http::{HeaderName, HeaderValue, Method, StatusCode, header, request::Parts};
use axum::response::{IntoResponse, Response};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;

#[cfg(feature = "postgres")]
pub use idempotent_core::PostgresStore;
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub use idempotent_core::SetupError;
#[cfg(feature = "sqlite")]
pub use idempotent_core::SqliteStore;
pub use idempotent_core::{
    DEFAULT_LEASE, DEFAULT_TTL, DurationError, Engine, Fingerprint, IdempotencyKey, KeyError,
    MemoryStore, Problem, Scope, ScopeError, ScopeValue, Store, StoreError, Sweeper,
    parse_duration,
};
/// The attribute (see the crate docs for its arguments).
pub use idempotent_macros::idempotent_axum as idempotent;

/// Default response size limit: 1 MiB.
pub const DEFAULT_MAX_RESPONSE: usize = 1 << 20;
/// Default request body limit of the layer: 2 MiB.
pub const DEFAULT_MAX_REQUEST: usize = 2 << 20;

/// The runtime configuration an app installs once (with [`Idempotency::layer`]).
#[derive(Clone)]
pub struct Idempotency {
    inner: Arc<Config>,
}

#[derive(Clone)]
struct Config {
    engine: Engine,
    ttl: Duration,
    lease: Duration,
    max_response: usize,
    max_request: usize,
    fail_open: bool,
}

impl std::fmt::Debug for Idempotency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idempotency")
            .field("ttl", &self.inner.ttl)
            .field("lease", &self.inner.lease)
            .field("max_response", &self.inner.max_response)
            .field("max_request", &self.inner.max_request)
            .field("fail_open", &self.inner.fail_open)
            .finish_non_exhaustive()
    }
}

impl Idempotency {
    /// Configuration over `store` with the defaults (ttl 24 h, lease 30 s, responses up to
    /// 1 MiB stored, request bodies up to 2 MiB, fail closed).
    pub fn new(store: impl Store) -> Self {
        Self::from_engine(Engine::new(store))
    }

    /// Configuration over an engine you built.
    pub fn from_engine(engine: Engine) -> Self {
        Idempotency {
            inner: Arc::new(Config {
                engine,
                ttl: DEFAULT_TTL,
                lease: DEFAULT_LEASE,
                max_response: DEFAULT_MAX_RESPONSE,
                max_request: DEFAULT_MAX_REQUEST,
                fail_open: false,
            }),
        }
    }

    fn with(mut self, f: impl FnOnce(&mut Config)) -> Self {
        f(Arc::make_mut(&mut self.inner));
        self
    }

    /// Default ttl for routes that do not set one.
    #[must_use]
    pub fn ttl(self, ttl: Duration) -> Self {
        self.with(|c| c.ttl = ttl)
    }

    /// Default lease for routes that do not set one.
    #[must_use]
    pub fn lease(self, lease: Duration) -> Self {
        self.with(|c| c.lease = lease)
    }

    /// Default limit on stored responses for routes that do not set one.
    #[must_use]
    pub fn max_response(self, bytes: usize) -> Self {
        self.with(|c| c.max_response = bytes)
    }

    /// Largest request body the layer buffers; larger requests get 413.
    #[must_use]
    pub fn max_request(self, bytes: usize) -> Self {
        self.with(|c| c.max_request = bytes)
    }

    /// Run handlers unprotected when the store fails (default: refuse with 503).
    #[must_use]
    pub fn fail_open(self, on: bool) -> Self {
        self.with(|c| c.fail_open = on)
    }

    /// The engine.
    pub fn engine(&self) -> &Engine {
        &self.inner.engine
    }

    /// The tower layer that installs this configuration: `.layer(idempotency.layer())`.
    pub fn layer(&self) -> IdempotencyLayer {
        IdempotencyLayer {
            config: self.clone(),
        }
    }
}

/// Installs an [`Idempotency`] and buffers unsafe requests' bodies (see the crate docs).
#[derive(Debug, Clone)]
pub struct IdempotencyLayer {
    config: Idempotency,
}

impl<S> tower_layer::Layer<S> for IdempotencyLayer {
    type Service = IdempotencyService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService {
            inner,
            config: self.config.clone(),
        }
    }
}

/// The service of [`IdempotencyLayer`].
#[derive(Debug, Clone)]
pub struct IdempotencyService<S> {
    inner: S,
    config: Idempotency,
}

#[derive(Clone)]
struct BufferedBody(Bytes);

impl<S> tower_service::Service<Request> for IdempotencyService<S>
where
    S: tower_service::Service<Request, Response = Response> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request) -> Self::Future {
        let config = self.config.clone();
        // The clone is not ready; swap so the ready one serves this request.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(async move {
            if !is_safe(req.method()) {
                let (mut parts, body) = req.into_parts();
                match axum::body::to_bytes(body, config.inner.max_request).await {
                    Ok(bytes) => {
                        parts.extensions.insert(BufferedBody(bytes.clone()));
                        req = Request::from_parts(parts, Body::from(bytes));
                    }
                    Err(_) => {
                        return Ok(problem(&Problem::request_too_large(
                            config.inner.max_request,
                        )));
                    }
                }
            }
            req.extensions_mut().insert(config);
            inner.call(req).await
        })
    }
}

fn is_safe(method: &Method) -> bool {
    matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS)
}

/// Renders a problem as `application/problem+json` with `Cache-Control: no-store`.
pub fn problem(p: &Problem) -> Response {
    let mut res = Response::new(Body::from(p.to_json()));
    *res.status_mut() = StatusCode::from_u16(p.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let h = res.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    if let Some(secs) = p.retry_after {
        h.insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    res
}

/// Headers never stored: hop-by-hop ones, `Date`, `Content-Length` and `Set-Cookie`.
fn storable(name: &HeaderName) -> bool {
    !matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "proxy-connection"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "date"
            | "content-length"
            | "set-cookie"
            | "idempotent-replayed"
    )
}

const REPLAYED: &str = "idempotent-replayed";

#[doc(hidden)]
/// Not a stable API: the code `#[idempotent]` generates calls these.
pub mod __private {
    use super::*;
    use idempotent_core::{
        ExecuteRequest, FingerprintInput, Handled, KeyRequirement, Outcome, Policy, StoredOutcome,
        StoredResponse,
    };

    pub use ::core::time::Duration;
    pub use axum::response::Response;
    pub use idempotent_core::KeyRequirement as Key;

    /// What the request carries for idempotency, read before the user's extractors.
    pub struct Context {
        config: Idempotency,
        method: Method,
        route: String,
        query: Option<String>,
        content_type: Option<String>,
        key: Result<IdempotencyKey, KeyError>,
        body: Bytes,
    }

    impl<S: Send + Sync> FromRequestParts<S> for Context {
        type Rejection = Response;

        async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Response> {
            let Some(config) = parts.extensions.get::<Idempotency>().cloned() else {
                return Err(problem(&Problem::misconfigured(
                    "this route uses #[idempotent] but the router has no idempotency layer; add `.layer(idempotency.layer())`",
                )));
            };
            let body = parts
                .extensions
                .get::<BufferedBody>()
                .map(|b| b.0.clone())
                .unwrap_or_default();
            let route = parts
                .extensions
                .get::<MatchedPath>()
                .map_or_else(|| parts.uri.path().to_owned(), |m| m.as_str().to_owned());
            Ok(Context {
                config,
                method: parts.method.clone(),
                route,
                query: parts.uri.query().map(str::to_owned),
                content_type: parts
                    .headers
                    .get(header::CONTENT_TYPE)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned),
                key: IdempotencyKey::from_header_values(
                    parts
                        .headers
                        .get_all("idempotency-key")
                        .iter()
                        .map(HeaderValue::as_bytes),
                ),
                body,
            })
        }
    }

    /// The attribute's arguments; `None` takes the [`Idempotency`] default.
    #[derive(Debug, Clone, Copy)]
    pub struct RouteArgs {
        /// ttl override.
        pub ttl: Option<Duration>,
        /// lease override.
        pub lease: Option<Duration>,
        /// key requirement.
        pub key: KeyRequirement,
        /// store 5xx.
        pub store_server_errors: bool,
        /// response size limit override.
        pub max_response: Option<usize>,
    }

    /// The scope of a handler parameter (type-checks it against [`ScopeValue`]).
    pub fn scope_of<T: ScopeValue + ?Sized>(value: &T) -> Result<Scope, ScopeError> {
        value.to_scope()
    }

    /// The unscoped namespace.
    pub fn unscoped() -> Result<Scope, ScopeError> {
        Ok(Scope::unscoped())
    }

    /// Claim → execute → store → replay, around the user's handler body.
    pub async fn run<F, R>(
        ctx: Context,
        scope: Result<Scope, ScopeError>,
        args: RouteArgs,
        handler: F,
    ) -> Response
    where
        F: Future<Output = R>,
        R: IntoResponse,
    {
        if is_safe(&ctx.method) {
            return handler.await.into_response();
        }
        let config = &ctx.config.inner;
        let scope = match scope {
            Ok(scope) => scope,
            Err(e) => return problem(&Problem::scope(&e)),
        };
        let policy = Policy {
            ttl: args.ttl.unwrap_or(config.ttl),
            lease: args.lease.unwrap_or(config.lease),
            store_server_errors: args.store_server_errors,
            key: args.key,
            fail_open: config.fail_open,
        };
        let max_response = args.max_response.unwrap_or(config.max_response);
        let fingerprint = Fingerprint::compute(&FingerprintInput {
            method: ctx.method.as_str(),
            route: &ctx.route,
            query: ctx.query.as_deref(),
            content_type: ctx.content_type.as_deref(),
            body: &ctx.body,
        });
        let request = ExecuteRequest {
            scope,
            key: ctx.key,
            fingerprint,
        };
        let outcome = config
            .engine
            .execute(request, &policy, || async move {
                capture(handler.await.into_response(), max_response).await
            })
            .await;
        match outcome {
            Outcome::Executed { mut value, .. } => {
                value
                    .headers_mut()
                    .insert(REPLAYED, HeaderValue::from_static("false"));
                value
            }
            Outcome::Replayed(StoredOutcome::Response(stored)) => replay(stored),
            Outcome::Replayed(StoredOutcome::Oversized { status, size }) => {
                problem(&Problem::response_not_stored(status, size))
            }
            Outcome::InProgress { retry_after } => problem(&Problem::in_progress(retry_after)),
            Outcome::Mismatch { in_progress } => problem(&Problem::mismatch(in_progress)),
            Outcome::KeyRejected(e) => problem(&Problem::key(&e)),
            Outcome::StoreUnavailable(e) => problem(&Problem::store_unavailable(&e)),
            Outcome::NoKey(value) | Outcome::FailedOpen { value, .. } => value,
            _ => problem(&Problem::misconfigured("unexpected engine outcome")),
        }
    }

    async fn capture(response: Response, max: usize) -> Handled<Response> {
        let (parts, body) = response.into_parts();
        let status = parts.status.as_u16();
        match axum::body::to_bytes(body, usize::MAX).await {
            Ok(bytes) => {
                let record = if bytes.len() > max {
                    StoredOutcome::Oversized {
                        status,
                        size: bytes.len() as u64,
                    }
                } else {
                    StoredOutcome::Response(StoredResponse {
                        status,
                        headers: parts
                            .headers
                            .iter()
                            .filter(|(n, _)| storable(n))
                            .map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec()))
                            .collect(),
                        body: bytes.to_vec(),
                    })
                };
                Handled {
                    value: Response::from_parts(parts, Body::from(bytes)),
                    record,
                }
            }
            Err(_) => {
                // The response body failed mid-stream: the client gets a 500 and the key is
                // released (a 5xx), so a retry runs again.
                let p = Problem::misconfigured(
                    "the handler's response body failed while it was being read",
                );
                Handled {
                    value: problem(&p),
                    record: StoredOutcome::Response(StoredResponse::new(500, Vec::new())),
                }
            }
        }
    }

    fn replay(stored: StoredResponse) -> Response {
        let mut res = Response::new(Body::from(stored.body));
        *res.status_mut() = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::OK);
        let headers = res.headers_mut();
        for (name, value) in stored.headers {
            if let (Ok(n), Ok(v)) = (
                HeaderName::from_bytes(name.as_bytes()),
                HeaderValue::from_bytes(&value),
            ) {
                headers.append(n, v);
            }
        }
        headers.insert(REPLAYED, HeaderValue::from_static("true"));
        res
    }

    /// Anchors the handler body's type to the declared return type.
    pub fn anchor<R, F: Future<Output = R>>(f: F) -> F {
        f
    }
}
