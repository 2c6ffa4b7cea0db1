//! Not a stable API: the code `#[idempotent]` generates calls these, and only these.

use crate::config::Idempotency;
use crate::response::{ProblemError, finish, problem, reply};
use actix_web::dev::Payload;
use actix_web::http::header::{self, HeaderValue};
use actix_web::web::Bytes;
use actix_web::{FromRequest, HttpMessage, HttpRequest, HttpResponse, Responder};
use futures_util::StreamExt;
use idempotent_core::http::{
    IDEMPOTENCY_KEY, RequestHead, Step, check_content_length, check_key, is_safe_method,
};
use idempotent_core::{
    ExecuteRequest, IdempotencyKey, KeyError, KeyRequirement, Problem, Scope, ScopeError,
    ScopeValue,
};
use std::future::{Future, ready};
use std::pin::Pin;
#[cfg(any(feature = "sqlite", feature = "postgres"))]
use {
    idempotent_core::http::{
        FIRST_EXECUTION, TxReply, TxStep, begin_transactional, finish_transactional,
    },
    idempotent_core::{Transaction, TxDatabase},
};

pub use ::core::time::Duration;
pub use actix_web::HttpResponse as Output;
pub use idempotent_core::CommitPath as Commit;
pub use idempotent_core::KeyRequirement as Key;
pub use idempotent_core::http::Route;

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
    config: Option<Idempotency>,
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
        let mut ready = Ready {
            config: req.extensions().get::<Idempotency>().cloned(),
            req: req.clone(),
            key: Err(KeyError::Missing),
            body: Bytes::new(),
        };
        let Some(config) = ready.config.clone() else {
            return refuse(misconfigured(
                "a handler uses #[idempotent] but its app has no idempotency middleware; add `.wrap(idempotency.middleware())`",
            ));
        };
        if is_safe_method(req.method().as_str()) {
            return pass_through(ready, payload);
        }
        // Cheap rejections first: the key, then the declared length, before reading a byte.
        ready.key = IdempotencyKey::from_header_values(
            req.headers()
                .get_all(IDEMPOTENCY_KEY)
                .map(HeaderValue::as_bytes),
        );
        let requirement = if REQUIRED {
            KeyRequirement::Required
        } else {
            KeyRequirement::Optional
        };
        if let Err(p) = check_key(&ready.key, requirement) {
            idempotent_core::observe::rejected(req.match_pattern().as_deref());
            return refuse(ProblemError::new(*p));
        }
        if ready.key.is_err() {
            // No key on an optional route: the request runs unprotected, so its body is left
            // for the handler (and its own limits) and never fingerprinted.
            return pass_through(ready, payload);
        }
        let limit = config.config.max_request();
        if let Err(p) = check_content_length(
            req.headers()
                .get(header::CONTENT_LENGTH)
                .map(HeaderValue::as_bytes),
            limit,
        ) {
            return refuse(ProblemError::new(*p));
        }
        let original = payload.take();
        let timeout = config.config.request_body_timeout();
        Box::pin(async move {
            let read = async {
                let raw = read_limited(original, limit).await?;
                let decoded = decoded(&raw, ready.req.headers(), limit).await?;
                Ok((raw, decoded))
            };
            let raw;
            (raw, ready.body) = match tokio::time::timeout(timeout, read).await {
                Ok(Ok(read)) => read,
                Ok(Err(p)) => return Err(ProblemError::new(p).into()),
                Err(_) => return Err(ProblemError::new(Problem::request_timeout(timeout)).into()),
            };
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

/// The whole of `body`, at most `limit` bytes: 413 past it, 400 for a broken stream.
async fn read_limited<E>(
    body: impl futures_core::Stream<Item = Result<Bytes, E>>,
    limit: usize,
) -> Result<Bytes, Problem> {
    let mut body = std::pin::pin!(body);
    let mut read = actix_web::web::BytesMut::new();
    while let Some(chunk) = body.next().await {
        let Ok(chunk) = chunk else {
            return Err(Problem::request_body_invalid());
        };
        if read.len() + chunk.len() > limit {
            return Err(Problem::request_too_large(limit));
        }
        read.extend_from_slice(&chunk);
    }
    Ok(read.freeze())
}

/// The body the request means: `raw` decoded by its `Content-Encoding` (gzip, deflate, br,
/// zstd) as actix-web's own extractors decode it, so a compressor's incidental bytes (a gzip
/// timestamp) never change the fingerprint. The limit applies to the decoded bytes, and
/// decoding stops there (a small body that would expand enormously is 413 at the limit, never
/// decoded whole); a body that does not decode is 400. Unknown encodings, and lists of several,
/// are left as they are, as actix-web leaves them. Decoded on the blocking pool.
async fn decoded(
    raw: &Bytes,
    headers: &actix_web::http::header::HeaderMap,
    limit: usize,
) -> Result<Bytes, Problem> {
    #[cfg(any(
        feature = "compress-gzip",
        feature = "compress-brotli",
        feature = "compress-zstd"
    ))]
    if let Some(encoding) = headers
        .get(header::CONTENT_ENCODING)
        .and_then(|v| crate::decode::Encoding::parse(v.as_bytes()))
    {
        use crate::decode::{DecodeError, decode};
        let raw = raw.clone();
        let decoded = tokio::task::spawn_blocking(move || decode(encoding, &raw, limit)).await;
        return match decoded {
            Ok(Ok(body)) => Ok(Bytes::from(body)),
            Ok(Err(DecodeError::TooLarge)) => Err(Problem::request_too_large(limit)),
            // Not valid in its encoding (or the decoder's task failed: a runtime shutting down).
            Ok(Err(DecodeError::Invalid)) | Err(_) => Err(Problem::request_body_invalid()),
        };
    }
    let _ = (headers, limit);
    Ok(raw.clone())
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

/// The engine's view of the request: scope, key and fingerprint (a large body's off the
/// async worker).
async fn execute_request(
    req: &HttpRequest,
    key: Result<IdempotencyKey, KeyError>,
    body: Bytes,
    scope: Result<Scope, ScopeError>,
) -> Result<ExecuteRequest, ScopeError> {
    let scope = scope?;
    let head = RequestHead {
        method: req.method().as_str(),
        path: req.path(),
        query: req.uri().query(),
        content_type: req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok()),
    };
    Ok(ExecuteRequest {
        scope,
        fingerprint: head.fingerprint_async(body).await,
        key,
    })
}

/// The scope of a handler parameter (type-checks it against [`ScopeValue`]).
pub fn scope_of<T: ScopeValue + ?Sized>(value: &T) -> Result<Scope, ScopeError> {
    value.to_scope()
}

/// The unscoped namespace.
pub fn unscoped() -> Result<Scope, ScopeError> {
    Ok(Scope::unscoped())
}

/// The handler's [`Idempotent`](idempotent_core::Idempotent) parameter, or the 500 that
/// refuses the request when no derive secret is configured.
pub fn context(
    ctx: &Ready,
    route: &Route,
    scope: &Result<Scope, ScopeError>,
) -> Result<idempotent_core::Idempotent, Box<HttpResponse>> {
    let Some(config) = &ctx.config else {
        return Err(Box::new(problem(&Problem::misconfigured())));
    };
    idempotent_core::http::idempotent_context(
        &config.config,
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
/// after it run as a task of their own on the worker's runtime: if the client goes away (a
/// reset, or a half-close after which actix stops polling the handler), the execution still
/// runs to the end and its outcome is stored.
pub async fn run<F, R>(
    ctx: Ready,
    route: &'static Route,
    scope: Result<Scope, ScopeError>,
    handler: F,
) -> HttpResponse
where
    F: Future<Output = R> + 'static,
    R: Responder + 'static,
{
    let req = ctx.req;
    let config = match &ctx.config {
        Some(config) if !is_safe_method(req.method().as_str()) && ctx.key.is_ok() => &config.config,
        // Safe methods ignore the key; a missing key got here only where it is optional.
        _ => return handler.await.respond_to(&req).map_into_boxed_body(),
    };
    let Ok(resolved) = route.resolve(config) else {
        // `resolve` logged what does not fit, naming the route.
        return problem(&Problem::misconfigured());
    };
    let request = match execute_request(&req, ctx.key, ctx.body, scope).await {
        Ok(request) => request,
        Err(e) => return problem(&Problem::scope(&e)),
    };
    let engine = config.engine().clone();
    let task = actix_rt::spawn(async move {
        match Step::from(engine.begin(request, &resolved.policy).await) {
            Step::Respond(r) => reply(r),
            Step::Unprotected => handler.await.respond_to(&req).map_into_boxed_body(),
            Step::Execute(mut execution) => {
                let response = execution
                    .run(handler)
                    .await
                    .map(|out| out.respond_to(&req).map_into_boxed_body());
                match response {
                    Ok(response) => finish(execution, response, resolved.max_response).await,
                    Err(panic) => {
                        execution.release().await;
                        std::panic::resume_unwind(panic)
                    }
                }
            }
        }
    });
    joined(task).await
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
/// is sent before that commit.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub async fn run_tx<DB, F, Fut, R>(
    ctx: Ready,
    route: &'static Route,
    scope: Result<Scope, ScopeError>,
    handler: F,
) -> HttpResponse
where
    DB: TxDatabase,
    F: FnOnce(Transaction<DB>) -> Fut + 'static,
    Fut: Future<Output = R> + 'static,
    R: Responder + 'static,
{
    let req = ctx.req;
    let Some(config) = &ctx.config else {
        // The context refuses a request without the middleware before the handler runs.
        return problem(&Problem::misconfigured());
    };
    let config = &config.config;
    let Ok(resolved) = route.resolve(config) else {
        return problem(&Problem::misconfigured());
    };
    let options = route.tx_options(config, DB::DEFAULT_COMMIT);
    let engine = config.engine().clone();
    // Safe methods ignore the key; a missing key got here only where it is optional.
    let request = if is_safe_method(req.method().as_str()) || ctx.key.is_err() {
        None
    } else {
        match execute_request(&req, ctx.key, ctx.body, scope).await {
            Ok(request) => Some(request),
            Err(e) => return problem(&Problem::scope(&e)),
        }
    };
    let task = actix_rt::spawn(async move {
        let policy = &resolved.policy;
        let (mut execution, tx) =
            match begin_transactional::<DB>(&engine, request, policy, &options).await {
                TxStep::Respond(r) => return reply(r),
                TxStep::Run(execution, tx) => (execution, tx),
            };
        let read = execution
            .run(async {
                let response = handler(tx).await.respond_to(&req);
                let (response, body) = response.into_parts();
                (response, actix_web::body::to_bytes(body).await)
            })
            .await;
        let (response, body) = match read {
            Ok((response, Ok(body))) => (response, body),
            Ok((_, Err(_))) => {
                execution.abort().await;
                return problem(&Problem::response_failed());
            }
            Err(panic) => {
                execution.abort().await;
                std::panic::resume_unwind(panic)
            }
        };
        let headers = response
            .headers()
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_bytes()));
        let status = response.status().as_u16();
        match finish_transactional(execution, status, headers, &body, resolved.max_response).await {
            TxReply::Respond(r) => reply(r),
            TxReply::Send { first_execution } => {
                let mut response = response.set_body(body).map_into_boxed_body();
                if first_execution {
                    response.headers_mut().insert(
                        header::HeaderName::from_static(FIRST_EXECUTION.0),
                        HeaderValue::from_static(FIRST_EXECUTION.1),
                    );
                }
                response
            }
        }
    });
    joined(task).await
}
