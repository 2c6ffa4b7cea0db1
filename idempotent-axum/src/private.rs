//! Not a stable API: the code `#[idempotent]` generates calls these, and only these.

use crate::config::Idempotency;
use crate::layer::BodySlot;
use crate::response::{Axum, problem};
use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, MatchedPath, OriginalUri, Request};
use axum::http::{HeaderValue, Method, Uri, header, request::Parts};
use axum::response::{IntoResponse, Response};
use idempotent_core::__private::RequestHead;
use idempotent_core::__private::driver::{self, Prepared};
use idempotent_core::{__private::Detached, IdempotencyKey, KeyError, Problem, Scope, ScopeError};
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
use idempotent_core::{Transaction, tx::TxDatabase};
use std::future::Future;

pub use ::core::time::Duration;
pub use axum::response::Response as Output;
pub use idempotent_core::__private::{Route, RouteArgs};
pub use idempotent_core::CommitPath as Commit;
pub use idempotent_core::engine::KeyRequirement as Key;

/// What the request carries for idempotency, read before the handler's own extractors: the
/// configuration, the request's identity, its key, and its body. `REQUIRED` is whether the
/// route requires a key, so a missing or malformed key is refused before the body is read.
pub struct Context<const REQUIRED: bool> {
    config: Idempotency,
    head: Head,
    key: Result<IdempotencyKey, KeyError>,
    body: Bytes,
}

impl<const REQUIRED: bool> std::fmt::Debug for Context<REQUIRED> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key or the body: this shows up in `#[tracing::instrument]` fields.
        f.debug_struct("Context")
            .field("method", &self.head.0)
            .field("path", &self.head.1.path())
            .finish_non_exhaustive()
    }
}

impl<S: Send + Sync, const REQUIRED: bool> FromRequestParts<S> for Context<REQUIRED> {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Response> {
        let Some(config) = parts.extensions.get::<Idempotency>().cloned() else {
            return Err(misconfigured(
                "a route uses #[idempotent] but its router has no idempotency layer; add `.layer(idempotency.layer())`",
            ));
        };
        let uri = parts
            .extensions
            .get::<OriginalUri>()
            .map_or_else(|| parts.uri.clone(), |o| o.0.clone());
        let route = parts.extensions.get::<MatchedPath>().cloned();
        let headers = &parts.headers;
        let admitted = driver::admit(
            &config.config,
            REQUIRED,
            parts.method.as_str(),
            headers
                .get_all(driver::KEY_HEADER)
                .iter()
                .map(HeaderValue::as_bytes),
            headers
                .get(header::CONTENT_LENGTH)
                .map(HeaderValue::as_bytes),
            || route.as_ref().map(MatchedPath::as_str),
        )
        .map_err(|p| problem(&p))?;
        let mut ctx = Context {
            config,
            head: Head(
                parts.method.clone(),
                uri,
                headers.get(header::CONTENT_TYPE).cloned(),
            ),
            key: admitted.key,
            body: Bytes::new(),
        };
        let Some((limit, timeout)) = admitted.read else {
            return Ok(ctx);
        };
        let Some(slot) = parts.extensions.get::<BodySlot>().cloned() else {
            return Err(misconfigured(
                "the idempotency layer must wrap the route: add `.layer(idempotency.layer())` to its router",
            ));
        };
        let Some(body) = slot.take_for_reading() else {
            return Err(misconfigured(
                "the request body was read before the idempotency context (is the context extracted twice?)",
            ));
        };
        let read = driver::within(timeout, driver::read_body(body.into_data_stream(), limit)).await;
        slot.put_read(read.as_ref().map_or_else(|_| Bytes::new(), Bytes::clone));
        ctx.body = read.map_err(|p| problem(&p))?;
        Ok(ctx)
    }
}

/// The handler's last extractor, as `#[idempotent]` passes it to [`run`]: one that reads the
/// body (a `FromRequest` extractor: `Json`, `Form`, `Bytes`, …) is deferred, run by `run` only
/// when the handler is about to run, so a request the replay cache answers never parses its
/// body again (its fingerprint matched a request whose extractors accepted that very body).
/// One that reads the request's parts only (`FromRequestParts`: an authorization guard, a
/// path) runs at once, in its place, as it always did. A body extractor that also checks
/// something (a webhook signature) is skipped on a hit like any other: such a route takes
/// `extract_on_replay`, and the attribute then passes no `Later`.
pub struct Later<T>(Deferred<T>);

/// Made by a body extractor's deferred run.
type Extracting<T> = std::pin::Pin<Box<dyn Future<Output = Result<T, Response>> + Send>>;

enum Deferred<T> {
    /// Extracted already (a parts extractor, or nothing: `()`).
    Ready(T),
    /// The request and state, to extract from when the handler runs.
    Later(Box<dyn FnOnce() -> Extracting<T> + Send>),
}

impl<T> std::fmt::Debug for Later<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the value: an extracted body shows up in `#[tracing::instrument]` fields.
        f.debug_struct("Later")
            .field("deferred", &matches!(self.0, Deferred::Later(..)))
            .finish_non_exhaustive()
    }
}

impl Later<()> {
    /// No extractor deferred.
    pub fn none() -> Self {
        Later(Deferred::Ready(()))
    }
}

impl<T> Later<T> {
    /// The extracted value, or the extractor's rejection as a response.
    async fn get(self) -> Result<T, Response> {
        match self.0 {
            Deferred::Ready(value) => Ok(value),
            Deferred::Later(extract) => extract().await,
        }
    }
}

impl<S, T> FromRequest<S> for Later<T>
where
    T: FromRequest<S> + Send + 'static,
    S: Clone + Send + Sync + 'static,
{
    type Rejection = std::convert::Infallible;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let state = state.clone();
        Ok(Later(Deferred::Later(Box::new(move || {
            Box::pin(async move {
                T::from_request(req, &state)
                    .await
                    .map_err(IntoResponse::into_response)
            })
        }))))
    }
}

impl<S, T> FromRequestParts<S> for Later<T>
where
    T: FromRequestParts<S> + Send,
    S: Send + Sync,
{
    type Rejection = T::Rejection;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        T::from_request_parts(parts, state)
            .await
            .map(|value| Later(Deferred::Ready(value)))
    }
}

/// What identifies a request besides its key and body.
struct Head(Method, Uri, Option<HeaderValue>);

impl Head {
    fn get(&self) -> RequestHead<'_> {
        RequestHead {
            method: self.0.as_str(),
            path: self.1.path(),
            query: self.1.query(),
            content_type: self.2.as_ref().and_then(|v| v.to_str().ok()),
        }
    }
}

/// The handler's [`Idempotent`](idempotent_core::Idempotent) parameter, or the 500 that
/// refuses the request when no derive secret is configured.
pub fn context<const REQUIRED: bool>(
    ctx: &Context<REQUIRED>,
    route: &Route,
    scope: &Result<Scope, ScopeError>,
) -> Result<idempotent_core::Idempotent, Box<Response>> {
    idempotent_core::__private::idempotent_context(
        &ctx.config.config,
        route,
        ctx.head.0.as_str(),
        &ctx.key,
        scope,
    )
    .map_err(|p| Box::new(problem(&p)))
}

/// The 500 problem for a server-side setup error; what to fix goes to the log, not the client.
fn misconfigured(what: &str) -> Response {
    tracing::error!("idempotency misconfigured: {what}");
    problem(&Problem::misconfigured())
}

/// Claim → execute → store → replay, around the handler's body. The claim and everything
/// after it run detached from the request: if the client goes away (even while the claim is
/// in flight), the execution still runs to the end and its outcome is stored.
///
/// `later` is the handler's last extractor ([`Later`]): a body extractor runs only after a
/// miss in the replay cache (and before the claim), and its rejection answers as usual.
///
/// `handler` makes the handler's future from that extractor's value (the attribute passes the
/// body as `move |value| async move { … }`): it is called only when the handler runs, so a
/// replay never builds it, and
/// the future it makes (as large as everything the handler awaits, often tens of KiB with a
/// database client's futures in it) is boxed as it is made, so the futures around it (this
/// one, the route's, the framework's, the detached execution) hold a pointer and never copy
/// it as they are built and moved.
pub fn run<const REQUIRED: bool, T, F, Fut, R>(
    ctx: Context<REQUIRED>,
    route: &'static Route,
    scope: Result<Scope, ScopeError>,
    later: Later<T>,
    handler: F,
) -> impl Future<Output = Response> + Send
where
    T: Send + 'static,
    F: FnOnce(T) -> Fut + Send + 'static,
    Fut: Future<Output = R> + Send + 'static,
    R: IntoResponse,
{
    let handler = move |value: T| {
        // The handler's own future boxed as `handler()` returns it, and only then wrapped. A
        // boxed async block around `handler().await` moved the future's whole size three
        // times a first execution (callgrind: the unstarted block into its box, then the
        // future on its way into the block's await); this moves it once, into its box.
        let future = Box::pin(handler(value));
        async move { future.await.into_response() }
    };
    // Not boxed: axum boxes the handler's future, which holds this one. A box of its own was
    // one more allocation per request, and over the 1,032 bytes that glibc serves from its
    // per-thread cache (1,096 with the benchmark's handler; BENCHMARKS.md, stop 43).
    async move {
        let config = &ctx.config.config;
        match driver::prepare(config, route, ctx.head.get(), ctx.key, ctx.body, scope).await {
            Prepared::Reply(reply) => crate::response::reply(reply),
            Prepared::Pass => match later.get().await {
                Ok(value) => handler(value).await,
                Err(rejected) => rejected,
            },
            Prepared::Run(mut job) => {
                let value = match later.get().await {
                    Ok(value) => value,
                    Err(rejected) => return rejected,
                };
                // Dropped with this future (the client went away): a wait for a duplicate's
                // answer ends; a claimed execution runs on, detached.
                let _caller = job.caller();
                Detached::new(job.run::<Axum, _>(move || handler(value))).await
            }
        }
    }
}

/// [`run`] for a handler that writes through a [`Transaction`] on the store's database `DB`
/// (transactional mode): the stored response commits with the handler's writes, and nothing
/// is sent before that commit. The handler's future is boxed as it is made (see [`run`]).
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub fn run_tx<const REQUIRED: bool, DB, F, Fut, R>(
    ctx: Context<REQUIRED>,
    route: &'static Route,
    scope: Result<Scope, ScopeError>,
    handler: F,
) -> impl Future<Output = Response> + Send
where
    DB: TxDatabase,
    F: FnOnce(Transaction<DB>) -> Fut + Send + 'static,
    Fut: Future<Output = R> + Send + 'static,
    R: IntoResponse,
{
    let handler = move |tx| {
        let future = Box::pin(handler(tx));
        async move { future.await.into_response() }
    };
    async move {
        let Context {
            config,
            head,
            key,
            body,
        } = ctx;
        match driver::prepare_tx::<DB>(&config.config, route, head.get(), key, body, scope).await {
            Ok(job) => Detached::new(job.run::<Axum, _, _>(handler)).await,
            Err(reply) => crate::response::reply(reply),
        }
    }
}
