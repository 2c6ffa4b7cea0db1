//! Not a stable API: the code `#[idempotent]` generates calls these, and only these.

use crate::config::Idempotency;
use crate::response::{Actix, ProblemError, problem};
use actix_web::dev::Payload;
use actix_web::http::header::{self, HeaderValue};
use actix_web::web::Bytes;
use actix_web::{FromRequest, HttpMessage, HttpRequest, HttpResponse, Responder};
use idempotent_core::__private::RequestHead;
use idempotent_core::__private::driver::{self, Prepared};
use idempotent_core::{IdempotencyKey, KeyError, Problem, Scope, ScopeError};
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
use idempotent_core::{Transaction, tx::TxDatabase};
use std::future::{Future, ready};
use std::pin::Pin;
use std::task::Poll;

pub use ::core::time::Duration;
pub use actix_web::HttpResponse as Output;
pub use idempotent_core::__private::{Route, RouteArgs};
pub use idempotent_core::CommitPath as Commit;
pub use idempotent_core::engine::KeyRequirement as Key;

/// The handler's one actix extractor: it does the idempotency checks of the request itself
/// first, then runs the handler's own extractors `A` (a tuple of the parameters as written)
/// over the same body, so the order is Axum's: a missing or malformed key (400), a declared
/// length over the limit (413), the body read (413 over the limit, 400 unreadable), and only
/// then your extractors' own rejections. (Actix polls a handler's extractors together, so a
/// separate context extractor could not answer first.) `REQUIRED` is whether the route
/// requires a key.
pub struct Context<const REQUIRED: bool, A> {
    ready: Ready,
    args: A,
}

/// The context without the handler's arguments, for [`run`].
pub struct Ready {
    config: Idempotency,
    req: HttpRequest,
    key: Result<IdempotencyKey, KeyError>,
    body: Bytes,
}

impl<const REQUIRED: bool, A> Context<REQUIRED, A> {
    /// The context and the handler's arguments.
    pub fn split(self) -> (Ready, A) {
        (self.ready, self.args)
    }
}

impl<const REQUIRED: bool, A> std::fmt::Debug for Context<REQUIRED, A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key or the body: this shows up in `#[tracing::instrument]` fields.
        f.debug_struct("Context")
            .field("method", self.ready.req.method())
            .field("path", &self.ready.req.path())
            .finish_non_exhaustive()
    }
}

type ContextFuture<const REQUIRED: bool, A> =
    Pin<Box<dyn Future<Output = Result<Context<REQUIRED, A>, actix_web::Error>>>>;

impl<const REQUIRED: bool, A> FromRequest for Context<REQUIRED, A>
where
    A: FromRequest + 'static,
{
    type Error = actix_web::Error;
    type Future = ContextFuture<REQUIRED, A>;

    fn from_request(req: &HttpRequest, payload: &mut Payload) -> Self::Future {
        let Some(config) = req.extensions().get::<Idempotency>().cloned() else {
            return refuse(misconfigured(
                "a handler uses #[idempotent] but its app has no idempotency middleware; add `.wrap(idempotency.middleware())`",
            ));
        };
        let headers = req.headers();
        let admitted = driver::admit(
            &config.config,
            REQUIRED,
            req.method().as_str(),
            headers
                .get_all(driver::KEY_HEADER)
                .map(HeaderValue::as_bytes),
            headers
                .get(header::CONTENT_LENGTH)
                .map(HeaderValue::as_bytes),
            || req.match_pattern(),
        );
        let admitted = match admitted {
            Ok(admitted) => admitted,
            Err(p) => return refuse(ProblemError::new(*p)),
        };
        let mut ready = Ready {
            config,
            req: req.clone(),
            key: admitted.key,
            body: Bytes::new(),
        };
        let Some((limit, timeout)) = admitted.read else {
            return pass_through(ready, payload);
        };
        let original = payload.take();
        Box::pin(async move {
            let encoding = ready.req.headers().get(header::CONTENT_ENCODING);
            let read = driver::within(timeout, async {
                let raw = driver::read_body(original, limit).await?;
                let decoded = driver::decoded(&raw, encoding.map(HeaderValue::as_bytes), limit);
                Ok((raw.clone(), decoded.await?))
            });
            let raw;
            (raw, ready.body) = read.await.map_err(|p| ProblemError::new(*p))?;
            // The handler's extractors read the same bytes as sent (they decode them as
            // they would without us), with their own limits.
            let mut replay = Payload::from(raw);
            let args = A::from_request(&ready.req, &mut replay)
                .await
                .map_err(Into::into)?;
            Ok(Context { ready, args })
        })
    }
}

/// The handler's own extractors on the request's payload, untouched.
fn pass_through<const REQUIRED: bool, A: FromRequest + 'static>(
    ready: Ready,
    payload: &mut Payload,
) -> ContextFuture<REQUIRED, A> {
    let args = A::from_request(&ready.req, payload);
    Box::pin(async move {
        let args = args.await.map_err(Into::into)?;
        Ok(Context { ready, args })
    })
}

fn refuse<T: 'static>(
    error: ProblemError,
) -> Pin<Box<dyn Future<Output = Result<T, actix_web::Error>>>> {
    Box::pin(ready(Err(error.into())))
}

/// What identifies a request besides its key and body.
fn head(req: &HttpRequest) -> RequestHead<'_> {
    RequestHead {
        method: req.method().as_str(),
        path: req.path(),
        query: req.uri().query(),
        content_type: req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok()),
    }
}

/// The handler's body extractor (`Json`, `Form`, `Bytes`, `String`) as `#[idempotent]` passes
/// it to [`run`]: run by `run` only when the handler is about to run, so a request the replay
/// cache answers never parses its body again (its fingerprint matched a request whose
/// extractors accepted that very body).
pub struct Later<T>(Deferred<T>);

enum Deferred<T> {
    /// Nothing deferred.
    Ready(T),
    /// The request and its payload (the body as sent), to extract from later.
    Later(HttpRequest, Payload),
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

impl<T: FromRequest> Later<T> {
    /// The extracted value, or the extractor's rejection as a response.
    async fn get(self) -> Result<T, HttpResponse> {
        match self.0 {
            Deferred::Ready(value) => Ok(value),
            Deferred::Later(req, mut payload) => T::from_request(&req, &mut payload)
                .await
                .map_err(|e| HttpResponse::from_error(e.into())),
        }
    }
}

impl<T: FromRequest> FromRequest for Later<T> {
    type Error = actix_web::Error;
    type Future = std::future::Ready<Result<Self, actix_web::Error>>;

    fn from_request(req: &HttpRequest, payload: &mut Payload) -> Self::Future {
        ready(Ok(Later(Deferred::Later(req.clone(), payload.take()))))
    }
}

/// The handler's [`Idempotent`](idempotent_core::Idempotent) parameter, or the 500 that
/// refuses the request when no derive secret is configured.
pub fn context(
    ctx: &Ready,
    route: &Route,
    scope: &Result<Scope, ScopeError>,
) -> Result<idempotent_core::Idempotent, Box<HttpResponse>> {
    idempotent_core::__private::idempotent_context(
        &ctx.config.config,
        route,
        ctx.req.method().as_str(),
        &ctx.key,
        scope,
    )
    .map_err(|p| Box::new(problem(&p)))
}

/// The 500 problem for a server-side setup error; what to fix goes to the log, not the client.
fn misconfigured(what: &str) -> ProblemError {
    tracing::error!("idempotency misconfigured: {what}");
    ProblemError::new(Problem::misconfigured())
}

/// Claim → execute → store → replay, around the handler's body. The claim and everything
/// after it run detached from the request (`detached`, below): if the client goes away (a
/// reset, or a half-close after which actix stops polling the handler), the execution still
/// runs to the end and its outcome is stored.
///
/// `later` is the handler's deferred body extractor ([`Later`]): it runs only after a miss in
/// the replay cache (and before the claim), and its rejection answers as usual.
///
/// `handler` makes the handler's future from that extractor's value (the attribute passes the
/// body as `move |value| async move { … }`): it is called only when the handler runs, so a
/// replay never builds it, and
/// the future it makes (as large as everything the handler awaits) is boxed as it is made,
/// so the futures around it and the detached job hold a pointer and never copy it.
pub fn run<T, F, Fut, R>(
    ctx: Ready,
    route: &'static Route,
    scope: Result<Scope, ScopeError>,
    later: Later<T>,
    handler: F,
) -> impl Future<Output = HttpResponse>
where
    T: FromRequest + 'static,
    F: FnOnce(T) -> Fut + 'static,
    Fut: Future<Output = R> + 'static,
    R: Responder + 'static,
{
    let req = ctx.req.clone();
    let handler = move |value: T| {
        // The handler's own future boxed as `handler()` returns it, and only then wrapped. A
        // boxed async block around `handler().await` moved the future's whole size three
        // times a first execution (callgrind: the unstarted block into its box, then the
        // future on its way into the block's await); this moves it once, into its box.
        let future = Box::pin(handler(value));
        async move { future.await.respond_to(&req).map_into_boxed_body() }
    };
    async move {
        let (config, head) = (&ctx.config.config, head(&ctx.req));
        let prepared = driver::prepare(config, route, head, ctx.key, ctx.body, scope);
        match prepared.await {
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
                detached(job.run::<Actix, _>(move || handler(value))).await
            }
        }
    }
}

/// Runs a claim and what follows it detached from the request. It is polled here once: a
/// job that finishes in that poll (a replay or a conflict from a store that answers at once,
/// a handler that does not wait) costs no task. One that has to wait is spawned at once as a
/// task of its own on the worker's runtime, before this future returns `Pending`, so it runs
/// to the end even if actix never polls the request again (a half-close) or drops it (a
/// reset). Where the thread has no actix arbiter (`Arbiter::try_current`, a thread-local that
/// `actix_rt::System` and actix's workers set) the job is spawned before it is polled, as it
/// always was, so a runtime that cannot spawn it fails before anything is claimed. A thread
/// that once ran a `System` keeps its arbiter: driving a handler there from outside actix's
/// runtime is not supported (see the crate's docs).
///
/// Not an `async fn`, which would hold the job twice (as its argument and, boxed, as a local).
fn detached(
    job: impl Future<Output = HttpResponse> + 'static,
) -> impl Future<Output = HttpResponse> {
    let mut job = Box::pin(job);
    let inline = actix_rt::Arbiter::try_current().is_some();
    async move {
        if inline
            && let Poll::Ready(response) =
                std::future::poll_fn(|cx| Poll::Ready(job.as_mut().poll(cx))).await
        {
            return response;
        }
        joined(actix_rt::spawn(job)).await
    }
}

/// The response of a spawned execution (a panic in it resumes here).
async fn joined(task: actix_rt::task::JoinHandle<HttpResponse>) -> HttpResponse {
    match task.await {
        Ok(response) => response,
        Err(error) if error.is_panic() => std::panic::resume_unwind(error.into_panic()),
        Err(_) => problem(&Problem::shutting_down()),
    }
}

/// [`run`] for a handler that writes through a [`Transaction`] on the store's database `DB`
/// (transactional mode): the stored response commits with the handler's writes, and nothing
/// is sent before that commit. The handler's future is boxed as it is made (see [`run`]).
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub fn run_tx<DB, F, Fut, R>(
    ctx: Ready,
    route: &'static Route,
    scope: Result<Scope, ScopeError>,
    handler: F,
) -> impl Future<Output = HttpResponse>
where
    DB: TxDatabase,
    F: FnOnce(Transaction<DB>) -> Fut + 'static,
    Fut: Future<Output = R> + 'static,
    R: Responder + 'static,
{
    let req = ctx.req.clone();
    let handler = move |tx| {
        let future = Box::pin(handler(tx));
        async move { future.await.respond_to(&req).map_into_boxed_body() }
    };
    async move {
        let (config, head) = (&ctx.config.config, head(&ctx.req));
        let prepared = driver::prepare_tx::<DB>(config, route, head, ctx.key, ctx.body, scope);
        match prepared.await {
            Ok(job) => detached(job.run::<Actix, _, _>(handler)).await,
            Err(reply) => crate::response::reply(reply),
        }
    }
}
