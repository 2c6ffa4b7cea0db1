//! Not a stable API: the code `#[idempotent]` generates calls these, and only these.

use crate::config::Idempotency;
use crate::response::{ProblemError, finish, problem, reply};
use actix_web::dev::Payload;
use actix_web::error::PayloadError;
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
use std::task::{Context as TaskContext, Poll};

pub use ::core::time::Duration;
pub use actix_web::HttpResponse as Output;
pub use idempotent_core::KeyRequirement as Key;
pub use idempotent_core::http::Route;

/// What the request carries for idempotency, read before the handler's own extractors: the
/// configuration, the request, its key, and its body. `REQUIRED` is whether the route
/// requires a key, so a missing or malformed key is refused before the body is read.
pub struct Context<const REQUIRED: bool> {
    config: Idempotency,
    req: HttpRequest,
    key: Result<IdempotencyKey, KeyError>,
    body: Bytes,
}

impl<const REQUIRED: bool> std::fmt::Debug for Context<REQUIRED> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key or the body: this shows up in `#[tracing::instrument]` fields.
        f.debug_struct("Context")
            .field("method", self.req.method())
            .field("path", &self.req.path())
            .finish_non_exhaustive()
    }
}

type ContextFuture<const REQUIRED: bool> =
    Pin<Box<dyn Future<Output = Result<Context<REQUIRED>, ProblemError>>>>;

impl<const REQUIRED: bool> FromRequest for Context<REQUIRED> {
    type Error = ProblemError;
    type Future = ContextFuture<REQUIRED>;

    fn from_request(req: &HttpRequest, payload: &mut Payload) -> Self::Future {
        let Some(config) = req.extensions().get::<Idempotency>().cloned() else {
            return Box::pin(ready(Err(misconfigured(
                "a handler uses #[idempotent] but its app has no idempotency middleware; add `.wrap(idempotency.middleware())`",
            ))));
        };
        let mut ctx = Context {
            config,
            req: req.clone(),
            key: Err(KeyError::Missing),
            body: Bytes::new(),
        };
        if is_safe_method(req.method().as_str()) {
            return Box::pin(ready(Ok(ctx)));
        }
        // Cheap rejections first: the key, then the declared length, before reading a byte.
        ctx.key = IdempotencyKey::from_header_values(
            req.headers()
                .get_all(IDEMPOTENCY_KEY)
                .map(HeaderValue::as_bytes),
        );
        let requirement = if REQUIRED {
            KeyRequirement::Required
        } else {
            KeyRequirement::Optional
        };
        if let Err(p) = check_key(&ctx.key, requirement) {
            return Box::pin(ready(Err(ProblemError::new(*p))));
        }
        if ctx.key.is_err() {
            // No key on an optional route: the request runs unprotected, so its body is left
            // for the handler (and its own limits) and never fingerprinted.
            return Box::pin(ready(Ok(ctx)));
        }
        let limit = ctx.config.config.max_request();
        if let Err(p) = check_content_length(
            req.headers()
                .get(header::CONTENT_LENGTH)
                .map(HeaderValue::as_bytes),
            limit,
        ) {
            return Box::pin(ready(Err(ProblemError::new(*p))));
        }
        // Take the body and leave the handler's extractors a payload that yields the same
        // bytes once they are read (actix polls all of a handler's extractors together).
        let mut original = payload.take();
        let (tx, rx) = tokio::sync::oneshot::channel();
        *payload = Payload::from(
            Box::pin(Handed { rx: Some(rx) }) as Pin<Box<dyn futures_core::Stream<Item = _>>>
        );
        Box::pin(async move {
            let mut body = actix_web::web::BytesMut::new();
            while let Some(chunk) = original.next().await {
                let Ok(chunk) = chunk else {
                    return Err(ProblemError::new(Problem::request_body_invalid()));
                };
                if body.len() + chunk.len() > limit {
                    return Err(ProblemError::new(Problem::request_too_large(limit)));
                }
                body.extend_from_slice(&chunk);
            }
            let body = body.freeze();
            let _ = tx.send(body.clone());
            ctx.body = body;
            Ok(ctx)
        })
    }
}

/// The payload the handler's own extractors read: the bytes the context read, once it has.
struct Handed {
    rx: Option<tokio::sync::oneshot::Receiver<Bytes>>,
}

impl futures_core::Stream for Handed {
    type Item = Result<Bytes, PayloadError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Option<Self::Item>> {
        let Some(rx) = self.rx.as_mut() else {
            return Poll::Ready(None);
        };
        let received = std::task::ready!(Pin::new(rx).poll(cx));
        self.rx = None;
        match received {
            Ok(bytes) if bytes.is_empty() => Poll::Ready(None),
            Ok(bytes) => Poll::Ready(Some(Ok(bytes))),
            // The context refused the request; its own error answers it.
            Err(_) => Poll::Ready(Some(Err(PayloadError::Incomplete(None)))),
        }
    }
}

/// The scope of a handler parameter (type-checks it against [`ScopeValue`]).
pub fn scope_of<T: ScopeValue + ?Sized>(value: &T) -> Result<Scope, ScopeError> {
    value.to_scope()
}

/// The unscoped namespace.
pub fn unscoped() -> Result<Scope, ScopeError> {
    Ok(Scope::unscoped())
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
pub async fn run<const REQUIRED: bool, F, R>(
    ctx: Context<REQUIRED>,
    route: &'static Route,
    scope: Result<Scope, ScopeError>,
    handler: F,
) -> HttpResponse
where
    F: Future<Output = R> + 'static,
    R: Responder + 'static,
{
    let req = ctx.req;
    if is_safe_method(req.method().as_str()) || ctx.key.is_err() {
        // Safe methods ignore the key; a missing key got here only where it is optional.
        return handler.await.respond_to(&req).map_into_boxed_body();
    }
    let config = &ctx.config.config;
    let Ok(resolved) = route.resolve(config) else {
        // `resolve` logged what does not fit, naming the route.
        return problem(&Problem::misconfigured());
    };
    let scope = match scope {
        Ok(scope) => scope,
        Err(e) => return problem(&Problem::scope(&e)),
    };
    let pattern = req.match_pattern();
    let head = RequestHead {
        method: req.method().as_str(),
        path: req.path(),
        query: req.uri().query(),
        content_type: req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok()),
        route: Some(pattern.as_deref().unwrap_or(req.path())),
    };
    let request = ExecuteRequest {
        scope,
        fingerprint: head.fingerprint(&ctx.body),
        key: ctx.key,
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
    match task.await {
        Ok(response) => response,
        Err(error) if error.is_panic() => std::panic::resume_unwind(error.into_panic()),
        Err(_) => problem(&Problem::shutting_down()),
    }
}
