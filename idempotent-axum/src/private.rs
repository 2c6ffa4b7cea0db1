//! Not a stable API: the code `#[idempotent]` generates calls these, and only these.

use crate::config::Idempotency;
use crate::layer::BodySlot;
use crate::response::{finish, problem, reply};
use axum::body::Bytes;
use axum::extract::{FromRequestParts, MatchedPath, OriginalUri};
use axum::http::{HeaderValue, Method, Uri, header, request::Parts};
use axum::response::{IntoResponse, Response};
use idempotent_core::http::{
    IDEMPOTENCY_KEY, RequestHead, Step, check_content_length, check_key, is_safe_method,
};
use idempotent_core::{
    Detached, ExecuteRequest, IdempotencyKey, KeyError, KeyRequirement, Problem, Scope, ScopeError,
    ScopeValue,
};
use std::future::Future;
#[cfg(any(feature = "sqlite", feature = "postgres"))]
use {
    axum::body::Body,
    http_body_util::{BodyExt, Collected},
    idempotent_core::http::{
        FIRST_EXECUTION, TxReply, TxStep, begin_transactional, finish_transactional,
    },
    idempotent_core::{Transaction, TxDatabase},
};

pub use ::core::time::Duration;
pub use axum::response::Response as Output;
pub use idempotent_core::CommitPath as Commit;
pub use idempotent_core::KeyRequirement as Key;
pub use idempotent_core::http::Route;

/// What the request carries for idempotency, read before the handler's own extractors: the
/// configuration, the request's identity, its key, and its body. `REQUIRED` is whether the
/// route requires a key, so a missing or malformed key is refused before the body is read.
pub struct Context<const REQUIRED: bool> {
    config: Idempotency,
    method: Method,
    uri: Uri,
    route: Option<MatchedPath>,
    content_type: Option<HeaderValue>,
    key: Result<IdempotencyKey, KeyError>,
    body: Bytes,
}

impl<const REQUIRED: bool> std::fmt::Debug for Context<REQUIRED> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key or the body: this shows up in `#[tracing::instrument]` fields.
        f.debug_struct("Context")
            .field("method", &self.method)
            .field("path", &self.uri.path())
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
        let mut ctx = Context {
            config,
            method: parts.method.clone(),
            uri,
            route: parts.extensions.get::<MatchedPath>().cloned(),
            content_type: parts.headers.get(header::CONTENT_TYPE).cloned(),
            key: Err(KeyError::Missing),
            body: Bytes::new(),
        };
        if is_safe_method(ctx.method.as_str()) {
            return Ok(ctx);
        }
        // Cheap rejections first: the key, then the declared length, before reading a byte.
        ctx.key = IdempotencyKey::from_header_values(
            parts
                .headers
                .get_all(IDEMPOTENCY_KEY)
                .iter()
                .map(HeaderValue::as_bytes),
        );
        let requirement = if REQUIRED {
            KeyRequirement::Required
        } else {
            KeyRequirement::Optional
        };
        check_key(&ctx.key, requirement).map_err(|p| {
            idempotent_core::observe::rejected(ctx.route.as_ref().map(MatchedPath::as_str));
            problem(&p)
        })?;
        if ctx.key.is_err() {
            // No key on an optional route: the request runs unprotected, so its body is left
            // for the handler (and its own limits) and never fingerprinted.
            return Ok(ctx);
        }
        let limit = ctx.config.config.max_request();
        check_content_length(
            parts
                .headers
                .get(header::CONTENT_LENGTH)
                .map(HeaderValue::as_bytes),
            limit,
        )
        .map_err(|p| problem(&p))?;
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
        let timeout = ctx.config.config.request_body_timeout();
        let Ok(read) = tokio::time::timeout(timeout, axum::body::to_bytes(body, limit)).await
        else {
            slot.put_read(Bytes::new());
            return Err(problem(&Problem::request_timeout(timeout)));
        };
        match read {
            Ok(bytes) => {
                slot.put_read(bytes.clone());
                ctx.body = bytes;
                Ok(ctx)
            }
            Err(error) => {
                slot.put_read(Bytes::new());
                let too_large = std::error::Error::source(&error)
                    .is_some_and(|e| e.is::<http_body_util::LengthLimitError>());
                Err(problem(&if too_large {
                    Problem::request_too_large(limit)
                } else {
                    Problem::request_body_invalid()
                }))
            }
        }
    }
}

impl<const REQUIRED: bool> Context<REQUIRED> {
    /// The engine's view of the request: scope, key and fingerprint (a large body's off the
    /// async worker).
    async fn request(self, scope: Result<Scope, ScopeError>) -> Result<ExecuteRequest, ScopeError> {
        let scope = scope?;
        let head = RequestHead {
            method: self.method.as_str(),
            path: self.uri.path(),
            query: self.uri.query(),
            content_type: self.content_type.as_ref().and_then(|v| v.to_str().ok()),
        };
        Ok(ExecuteRequest {
            scope,
            fingerprint: head.fingerprint_async(self.body.clone()).await,
            key: self.key,
        })
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

/// The handler's [`Idempotent`](idempotent_core::Idempotent) parameter, or the 500 that
/// refuses the request when no derive secret is configured.
pub fn context<const REQUIRED: bool>(
    ctx: &Context<REQUIRED>,
    route: &Route,
    scope: &Result<Scope, ScopeError>,
) -> Result<idempotent_core::Idempotent, Box<Response>> {
    idempotent_core::http::idempotent_context(
        &ctx.config.config,
        route,
        ctx.method.as_str(),
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
pub async fn run<const REQUIRED: bool, F, R>(
    ctx: Context<REQUIRED>,
    route: &'static Route,
    scope: Result<Scope, ScopeError>,
    handler: F,
) -> Response
where
    F: Future<Output = R> + Send + 'static,
    R: IntoResponse,
{
    if is_safe_method(ctx.method.as_str()) || ctx.key.is_err() {
        // Safe methods ignore the key; a missing key got here only where it is optional.
        return handler.await.into_response();
    }
    let config = &ctx.config.config;
    let Ok(resolved) = route.resolve(config) else {
        // `resolve` logged what does not fit, naming the route.
        return problem(&Problem::misconfigured());
    };
    let engine = config.engine().clone();
    let max_response = resolved.max_response;
    let request = match ctx.request(scope).await {
        Ok(request) => request,
        Err(e) => return problem(&Problem::scope(&e)),
    };
    Detached::new(async move {
        match Step::from(engine.begin(request, &resolved.policy).await) {
            Step::Respond(r) => reply(r),
            Step::Unprotected => handler.await.into_response(),
            Step::Execute(mut execution) => {
                let response = execution
                    .run(handler)
                    .await
                    .map(IntoResponse::into_response);
                match response {
                    Ok(response) => finish(execution, response, max_response).await,
                    Err(panic) => {
                        execution.release().await;
                        std::panic::resume_unwind(panic)
                    }
                }
            }
        }
    })
    .await
}

/// [`run`] for a handler that writes through a [`Transaction`] on the store's database `DB`
/// (transactional mode): the stored response commits with the handler's writes, and nothing
/// is sent before that commit.
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub async fn run_tx<const REQUIRED: bool, DB, F, Fut, R>(
    ctx: Context<REQUIRED>,
    route: &'static Route,
    scope: Result<Scope, ScopeError>,
    handler: F,
) -> Response
where
    DB: TxDatabase,
    F: FnOnce(Transaction<DB>) -> Fut + Send + 'static,
    Fut: Future<Output = R> + Send + 'static,
    R: IntoResponse,
{
    let config = &ctx.config.config;
    let Ok(resolved) = route.resolve(config) else {
        return problem(&Problem::misconfigured());
    };
    let options = route.tx_options(config, DB::DEFAULT_COMMIT);
    let engine = config.engine().clone();
    let (policy, max_response) = (resolved.policy, resolved.max_response);
    // Safe methods ignore the key; a missing key got here only where it is optional.
    let request = if is_safe_method(ctx.method.as_str()) || ctx.key.is_err() {
        None
    } else {
        match ctx.request(scope).await {
            Ok(request) => Some(request),
            Err(e) => return problem(&Problem::scope(&e)),
        }
    };
    Detached::new(async move {
        let policy = &policy;
        let (mut execution, tx) =
            match begin_transactional::<DB>(&engine, request, policy, &options).await {
                TxStep::Respond(r) => return reply(r),
                TxStep::Run(execution, tx) => (execution, tx),
            };
        let read = execution
            .run(async move {
                let (parts, body) = handler(tx).await.into_response().into_parts();
                (parts, body.collect().await.map(Collected::to_bytes))
            })
            .await;
        let (mut parts, body) = match read {
            Ok((parts, Ok(body))) => (parts, body),
            Ok((_, Err(_))) => {
                execution.abort().await;
                return problem(&Problem::response_failed());
            }
            Err(panic) => {
                execution.abort().await;
                std::panic::resume_unwind(panic)
            }
        };
        let headers = parts
            .headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_bytes()));
        match finish_transactional(
            execution,
            parts.status.as_u16(),
            headers,
            &body,
            max_response,
        )
        .await
        {
            TxReply::Respond(r) => reply(r),
            TxReply::Send { first_execution } => {
                if first_execution {
                    parts.headers.insert(
                        FIRST_EXECUTION.0,
                        HeaderValue::from_static(FIRST_EXECUTION.1),
                    );
                }
                Response::from_parts(parts, Body::from(body))
            }
        }
    })
    .await
}
