//! The request lifecycle, written once for every adapter: admit the request (key, declared
//! length, bounded body read), then claim → execute → store → replay around the handler, or in
//! transactional mode begin → handler → store with the commit.
//!
//! An adapter implements [`Glue`] for its framework (its response, body and head types, how a
//! body is collected, how a streamed one is recorded) and calls [`admit`], [`read_body`],
//! [`prepare`] and [`Job::run`] (or [`prepare_tx`] and [`TxJob::run`]). Nothing here requires
//! `Send`: the futures are `Send` exactly when the adapter's types and handler are, so Axum
//! runs them on a multi-threaded runtime (in place, spawned only if the request is dropped)
//! and Actix on its worker's local one (in place, spawned once the job first has to wait).

use super::capture::{Capture, Recorder, ResponsePlan};
use super::config::Config;
use super::reply::{Reply, Step};
use super::route::{Route, RoutePolicy};
use super::{IDEMPOTENCY_KEY, RequestHead, check_content_length, check_key, is_safe_method};
use crate::engine::{Engine, ExecuteRequest, Execution, KeyRequirement, Recorded};
use crate::key::{IdempotencyKey, KeyError};
use crate::problem::Problem;
use crate::scope::{Scope, ScopeError};
use crate::store::record::StoredOutcome;
use bytes::{Bytes, BytesMut};
use futures_util::{Stream, StreamExt};
use std::fmt::Display;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

/// What an adapter supplies: its framework's response type taken apart and put together.
pub trait Glue: 'static {
    /// The framework's response.
    type Response;
    /// A response without its body: status and headers.
    type Head;
    /// A response's body.
    type Body;
    /// Why collecting a body failed.
    type Error: Display;

    /// The library's own reply (a replay or a problem) as a response.
    fn reply(reply: Reply) -> Self::Response;
    /// A response taken apart.
    fn split(response: Self::Response) -> (Self::Head, Self::Body);
    /// A response put together.
    fn join(head: Self::Head, body: Self::Body) -> Self::Response;
    /// The head's status code.
    fn status(head: &Self::Head) -> u16;
    /// The head's header lines, in order.
    fn headers(head: &Self::Head) -> impl Iterator<Item = (&str, &[u8])>;
    /// Adds `Idempotent-Replayed: false` (`FIRST_EXECUTION`).
    fn mark_first_execution(head: &mut Self::Head);
    /// The body's exact length, when it is known before reading it.
    fn exact_len(body: &Self::Body) -> Option<u64>;
    /// The whole body.
    fn collect(body: Self::Body) -> impl Future<Output = Result<Bytes, Self::Error>>;
    /// A body of these bytes.
    fn from_bytes(bytes: Bytes) -> Self::Body;
    /// `body` on its way to the client, recorded by `recorder` as it goes (the adapter's body
    /// type around a [`Tee`]).
    fn tee(body: Self::Body, recorder: Recorder) -> Self::Body;
}

/// What [`admit`] decided about a request, before its body is read.
#[derive(Debug)]
pub struct Admitted {
    /// The request's key (`Err` where the request is not protected).
    pub key: Result<IdempotencyKey, KeyError>,
    /// Read the body, at most `limit` bytes within `timeout`, when the request is protected.
    pub read: Option<(usize, Duration)>,
}

/// The checks that run before a byte of the body is read: a safe method or (where the route
/// allows it) a missing key leaves the request unprotected and its body to the handler; a
/// malformed or missing key is 400 (counted as rejected under the route template
/// `route_template` gives, asked only then: finding it costs actix a lookup and a `String`
/// per request); a declared length over the limit is 413.
///
/// # Errors
/// The problem to answer with.
pub fn admit<'a, T: AsRef<str>>(
    config: &Config,
    required: bool,
    method: &str,
    keys: impl IntoIterator<Item = &'a [u8]>,
    content_length: Option<&[u8]>,
    route_template: impl FnOnce() -> Option<T>,
) -> Result<Admitted, Box<Problem>> {
    let mut admitted = Admitted {
        key: Err(KeyError::Missing),
        read: None,
    };
    if is_safe_method(method) {
        return Ok(admitted);
    }
    admitted.key = IdempotencyKey::from_header_values(keys);
    let requirement = if required {
        KeyRequirement::Required
    } else {
        KeyRequirement::Optional
    };
    if let Err(problem) = check_key(&admitted.key, requirement) {
        crate::observe::rejected(route_template().as_ref().map(AsRef::as_ref));
        return Err(problem);
    }
    if admitted.key.is_err() {
        // No key on an optional route: the request runs unprotected, so its body is left for
        // the handler (and its own limits) and never fingerprinted.
        return Ok(admitted);
    }
    let limit = config.max_request();
    check_content_length(content_length, limit)?;
    admitted.read = Some((limit, config.request_body_timeout()));
    Ok(admitted)
}

/// The name of the key header, for adapters that look it up.
pub const KEY_HEADER: &str = IDEMPOTENCY_KEY;

/// The whole of `body`, at most `limit` bytes: 413 past it, 400 for a broken stream.
///
/// A body that arrives as one chunk (a small request, as a server reads it) is returned as
/// that chunk, not copied (as axum's own body extractors take it); a body of several chunks
/// is copied into one buffer.
///
/// # Errors
/// The problem to answer with.
pub async fn read_body<E>(
    body: impl Stream<Item = Result<Bytes, E>>,
    limit: usize,
) -> Result<Bytes, Box<Problem>> {
    let mut body = std::pin::pin!(body);
    // The first chunk, kept as it is while no second one has come.
    let mut first: Option<Bytes> = None;
    let mut read = BytesMut::new();
    let mut len = 0usize;
    while let Some(chunk) = body.next().await {
        let Ok(chunk) = chunk else {
            return Err(Box::new(Problem::request_body_invalid()));
        };
        len = len.saturating_add(chunk.len());
        if len > limit {
            return Err(Box::new(Problem::request_too_large(limit)));
        }
        if first.is_none() && read.is_empty() {
            first = Some(chunk);
            continue;
        }
        if let Some(first) = first.take() {
            read.reserve(len);
            read.extend_from_slice(&first);
        }
        read.extend_from_slice(&chunk);
    }
    Ok(first.unwrap_or_else(|| read.freeze()))
}

/// `read` (a body read), refused with 408 when it takes longer than `timeout`.
///
/// # Errors
/// The read's own problem, or the 408 one.
pub async fn within<T>(
    timeout: Duration,
    read: impl Future<Output = Result<T, Box<Problem>>>,
) -> Result<T, Box<Problem>> {
    tokio::time::timeout(timeout, read)
        .await
        .unwrap_or_else(|_| Err(Box::new(Problem::request_timeout(timeout))))
}

/// The body the request means: `raw` decoded by its `Content-Encoding` (gzip, deflate, br,
/// zstd, as the `compress-*` features allow) as actix-web's own extractors decode it, so a
/// compressor's incidental bytes (a gzip timestamp) never change the fingerprint. The limit
/// applies to the decoded bytes, and decoding stops there (a small body that would expand
/// enormously is 413 at the limit, never decoded whole); a body that does not decode is 400.
/// Unknown encodings, and lists of several, are left as they are, as actix-web leaves them.
/// Decoded on the blocking pool.
///
/// # Errors
/// The problem to answer with.
pub async fn decoded(
    raw: &Bytes,
    content_encoding: Option<&[u8]>,
    limit: usize,
) -> Result<Bytes, Box<Problem>> {
    #[cfg(any(
        feature = "compress-gzip",
        feature = "compress-brotli",
        feature = "compress-zstd"
    ))]
    if let Some(encoding) = content_encoding.and_then(super::decode::Encoding::parse) {
        use super::decode::{DecodeError, decode};
        let raw = raw.clone();
        let decoded = tokio::task::spawn_blocking(move || decode(encoding, &raw, limit)).await;
        return match decoded {
            Ok(Ok(body)) => Ok(Bytes::from(body)),
            Ok(Err(DecodeError::TooLarge)) => Err(Box::new(Problem::request_too_large(limit))),
            // Not valid in its encoding (or the decoder's task failed: a runtime shutting down).
            Ok(Err(DecodeError::Invalid)) | Err(_) => {
                Err(Box::new(Problem::request_body_invalid()))
            }
        };
    }
    let _ = (content_encoding, limit);
    Ok(raw.clone())
}

/// What to do with a plain (non-transactional) route's request.
#[derive(Debug)]
pub enum Prepared {
    /// Answer with this (a misconfigured route, a scope that cannot be built).
    Reply(Reply),
    /// Run the handler unprotected: a safe method, or no key where it is optional.
    Pass,
    /// Claim and run ([`Job::run`]).
    Run(Job),
}

/// A protected request, ready to be claimed.
pub struct Job {
    engine: Engine,
    request: ExecuteRequest,
    resolved: RoutePolicy,
    /// Resolves when the request's client is gone ([`Job::caller`]).
    gone: Option<crate::engine::Gone>,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job")
            .field("request", &self.request)
            .field("resolved", &self.resolved)
            .field("watches_caller", &self.gone.is_some())
            .finish_non_exhaustive()
    }
}

/// Held by the request's own future while its [`Job`] runs detached: dropped (the client went
/// away, and the server dropped the request's future), it ends the job's wait for a running
/// duplicate's answer at once. A job that already claimed its record runs on regardless.
#[must_use = "the wait ends when this is dropped"]
#[derive(Debug)]
pub struct CallerGuard(
    #[allow(dead_code, reason = "held for its drop")] Option<tokio::sync::oneshot::Sender<()>>,
);

/// The engine's view of a request: its scope, key and fingerprint (a large body's computed off
/// the async worker).
async fn execute_request(
    head: &RequestHead<'_>,
    key: Result<IdempotencyKey, KeyError>,
    body: Bytes,
    scope: Result<Scope, ScopeError>,
) -> Result<ExecuteRequest, Reply> {
    let scope = scope.map_err(|e| Reply::problem(&Problem::scope(&e)))?;
    Ok(ExecuteRequest {
        scope,
        fingerprint: head.fingerprint_async(body).await,
        key,
    })
}

/// The route resolved against the configuration; a misfit was logged by [`Route::resolve`].
fn resolve(route: &Route, config: &Config) -> Result<RoutePolicy, Reply> {
    route
        .resolve(config)
        .map_err(|_| Reply::problem(&Problem::misconfigured()))
}

/// Resolves the route and identifies the request (scope, key, fingerprint of `body`).
///
/// Not an `async fn`, which would hold its arguments twice (see [`Job::run`]).
#[allow(
    clippy::manual_async_fn,
    reason = "an async fn holds its arguments twice"
)]
pub fn prepare<'a>(
    config: &'a Config,
    route: &'static Route,
    head: RequestHead<'a>,
    key: Result<IdempotencyKey, KeyError>,
    body: Bytes,
    scope: Result<Scope, ScopeError>,
) -> impl Future<Output = Prepared> + 'a {
    async move {
        if is_safe_method(head.method) || key.is_err() {
            // Safe methods ignore the key; a missing key got here only where it is optional.
            return Prepared::Pass;
        }
        let resolved = match resolve(route, config) {
            Ok(resolved) => resolved,
            Err(reply) => return Prepared::Reply(reply),
        };
        let request = match execute_request(&head, key, body, scope).await {
            Ok(request) => request,
            Err(reply) => return Prepared::Reply(reply),
        };
        // A record the replay cache holds is answered here, before the handler's deferred
        // extractors (its body's) run: they accepted this very body when the record was made.
        let engine = config.engine();
        match engine.cached(request, &resolved.policy) {
            Ok(begin) => Prepared::Reply(Reply::answer(begin)),
            Err(request) => Prepared::Run(Job {
                engine: engine.clone(),
                request,
                resolved,
                gone: None,
            }),
        }
    }
}

impl Job {
    /// The guard the request's own future holds while this job runs detached, so that the
    /// client going away ends a wait for a duplicate's answer ([`CallerGuard`]); nothing
    /// (no allocation) on a route that does not wait.
    pub fn caller(&mut self) -> CallerGuard {
        if self.resolved.policy.wait.is_zero() {
            return CallerGuard(None);
        }
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        self.gone = Some(Box::pin(async move {
            let _ = rx.await;
        }));
        CallerGuard(Some(tx))
    }

    /// Claim → execute → store → replay around `handler`. Run it detached from the request
    /// (spawned, or in [`Detached`](crate::__private::Detached)): once the key is claimed the handler
    /// runs to the end and its outcome is stored even if the client goes away. A panic in the
    /// handler releases the key and resumes here.
    ///
    /// The execution (the handler, then storing its response) is a future of its own, boxed
    /// when the key is claimed: the future this returns, which the adapter boxes or spawns
    /// for every request, holds the claim and the handler's inputs (about 0.7 KiB with the
    /// benchmark's handler, not 3.6), so a replay or a conflict never allocates and copies
    /// room for storing a response.
    ///
    /// `handler` makes the handler's future; it is called only when the handler runs (under
    /// the execution's panic guard, as the handler itself runs), so a replay or a conflict
    /// never builds it.
    ///
    /// Not an `async fn`: one would keep its arguments in the future twice (as arguments, and
    /// as the locals they move into), which put this future over 1 KiB.
    #[allow(
        clippy::manual_async_fn,
        reason = "an async fn holds its arguments twice"
    )]
    pub fn run<G: Glue, Fut: Future<Output = G::Response>>(
        self,
        handler: impl FnOnce() -> Fut,
    ) -> impl Future<Output = G::Response> {
        async move {
            let begin = self
                .engine
                // `prepare` looked in the replay cache already.
                .begin_traced(self.request, &self.resolved.policy, self.gone, true);
            match Step::from(begin.await) {
                Step::Respond(reply) => G::reply(reply),
                Step::Unprotected => handler().await,
                Step::Execute(execution) => {
                    let max_response = self.resolved.max_response;
                    Box::pin(execute::<G, _>(execution, handler, max_response)).await
                }
            }
        }
    }
}

/// Runs the handler under a claimed execution and finishes it with the response; a panic in
/// the handler (or in making its future) releases the key and resumes here.
///
/// Not an `async fn` (see [`Job::run`]).
#[allow(
    clippy::manual_async_fn,
    reason = "an async fn holds its arguments twice"
)]
fn execute<G: Glue, Fut: Future<Output = G::Response>>(
    mut execution: Execution,
    handler: impl FnOnce() -> Fut,
    max_response: usize,
) -> impl Future<Output = G::Response> {
    async move {
        match execution.run(async move { handler().await }).await {
            Ok(response) => finish::<G>(execution, response, max_response).await,
            Err(panic) => {
                execution.release().await;
                std::panic::resume_unwind(panic)
            }
        }
    }
}

/// Finishes a claimed execution with the handler's response and returns what the client gets,
/// following its response plan (released, collected, oversized or streamed); a streamed body is recorded as it goes ([`Glue::tee`]).
///
/// Not an `async fn` (see [`Job::run`]).
#[allow(
    clippy::manual_async_fn,
    reason = "an async fn holds its arguments twice"
)]
pub fn finish<G: Glue>(
    execution: Execution,
    response: G::Response,
    limit: usize,
) -> impl Future<Output = G::Response> {
    // Taken apart before the future is made, so the future does not keep the whole response
    // beside its parts.
    let (mut head, body) = G::split(response);
    let status = G::status(&head);
    let plan = ResponsePlan::new(execution.policy(), status, G::exact_len(&body), limit);
    async move {
        let capture = |head: &G::Head| Capture::new(status, G::headers(head), limit);
        let body = match plan {
            ResponsePlan::Release => {
                execution.release().await;
                return G::join(head, body);
            }
            ResponsePlan::Collect => {
                let mut recorder = Recorder::new(execution, capture(&head));
                match recorder.run(G::collect(body)).await {
                    Ok(Ok(bytes)) => {
                        recorder.data(&bytes);
                        recorder.end().await;
                        G::from_bytes(bytes)
                    }
                    Ok(Err(error)) => {
                        recorder.fail(&error.to_string()).await;
                        return G::reply(Reply::problem(&Problem::response_failed()));
                    }
                    Err(panic) => {
                        recorder.fail(&"the response body panicked").await;
                        std::panic::resume_unwind(panic)
                    }
                }
            }
            ResponsePlan::Oversized { size } => {
                execution
                    .finish(StoredOutcome::Oversized { status, size })
                    .await;
                body
            }
            ResponsePlan::Stream => {
                let recorder = Recorder::streaming(execution, capture(&head));
                G::tee(body, recorder)
            }
        };
        G::mark_first_execution(&mut head);
        G::join(head, body)
    }
}

/// The recording side of a streamed body on its way to the client, fed chunk by chunk (see
/// [`Recorder`] for the ends it can take). The adapter's body type holds one beside its inner
/// body and forwards `poll` to [`Tee::poll_next`]; work handed off (storing the marker,
/// releasing) is spawned on the current runtime.
pub struct Tee {
    state: TeeState,
}

enum TeeState {
    Recording(Box<Recorder>),
    Finishing(Pin<Box<dyn Future<Output = Recorded> + Send>>),
    Passthrough,
}

impl std::fmt::Debug for Tee {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match self.state {
            TeeState::Recording(_) => "recording",
            TeeState::Finishing(_) => "finishing",
            TeeState::Passthrough => "passthrough",
        };
        f.debug_struct("Tee").field("state", &state).finish()
    }
}

impl Tee {
    /// Records through `recorder`.
    pub fn new(recorder: Recorder) -> Self {
        Tee {
            state: TeeState::Recording(Box::new(recorder)),
        }
    }

    /// Takes the recorder out of a recording state, leaving the body to pass through.
    fn take(&mut self) -> Option<Recorder> {
        match std::mem::replace(&mut self.state, TeeState::Passthrough) {
            TeeState::Recording(recorder) => Some(*recorder),
            other => {
                self.state = other;
                None
            }
        }
    }

    /// The next chunk for the client: `next` polls the inner body, `data` gives a chunk's bytes
    /// (`None` for a chunk that carries none, such as trailers). The stream's end is passed on
    /// only after the response is stored.
    pub fn poll_next<T, E: Display>(
        &mut self,
        cx: &mut Context<'_>,
        mut next: impl FnMut(&mut Context<'_>) -> Poll<Option<Result<T, E>>>,
        data: impl Fn(&T) -> Option<&[u8]>,
    ) -> Poll<Option<Result<T, E>>> {
        loop {
            match &mut self.state {
                TeeState::Passthrough => return next(cx),
                TeeState::Finishing(store) => {
                    std::task::ready!(store.as_mut().poll(cx));
                    self.state = TeeState::Passthrough;
                    return Poll::Ready(None);
                }
                TeeState::Recording(recorder) => {
                    // Silent for a lease (polled, or seen by the heartbeat while unpolled).
                    if recorder.is_settled() || recorder.poll_expired(cx).is_ready() {
                        // Still streaming a lease later: not replayable; the rest goes through.
                        if let Some(recorder) = self.take() {
                            spawn(recorder.over_limit());
                        }
                        continue;
                    }
                    match std::task::ready!(next(cx)) {
                        Some(Ok(chunk)) => {
                            let within = data(&chunk).is_none_or(|bytes| recorder.data(bytes));
                            if !within && let Some(recorder) = self.take() {
                                spawn(recorder.over_limit());
                            }
                            return Poll::Ready(Some(Ok(chunk)));
                        }
                        Some(Err(error)) => {
                            if let Some(recorder) = self.take() {
                                let reason = error.to_string();
                                spawn(async move { recorder.fail(&reason).await });
                            }
                            return Poll::Ready(Some(Err(error)));
                        }
                        None => {
                            if let Some(recorder) = self.take() {
                                self.state = TeeState::Finishing(Box::pin(recorder.end()));
                            }
                        }
                    }
                }
            }
        }
    }

    /// Whether the recording is over (the rest passes through).
    pub fn is_passthrough(&self) -> bool {
        matches!(self.state, TeeState::Passthrough)
    }

    /// The body is dropped: storing what the client already has goes on in the background,
    /// and a recorder still recording (the client went away mid-stream) is returned, for the
    /// adapter to read the rest of the body with [`Recorder::abandon`].
    pub fn dropped(&mut self) -> Option<Recorder> {
        match std::mem::replace(&mut self.state, TeeState::Passthrough) {
            TeeState::Passthrough => None,
            // The client has every byte; storing them must not be cut short.
            TeeState::Finishing(store) => {
                spawn(store);
                None
            }
            TeeState::Recording(recorder) => Some(*recorder),
        }
    }
}

/// Spawns the rest of an execution's work onto the current runtime; outside one (a runtime
/// shutting down) the record stays in progress until its lease ends.
pub fn spawn(work: impl Future<Output = Recorded> + Send + 'static) {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => drop(runtime.spawn(work)),
        Err(_) => no_runtime(),
    }
}

/// Logs that work could not be spawned.
pub fn no_runtime() {
    tracing::warn!(
        "idempotency: no runtime to finish a response on; its record stays in progress until its lease ends"
    );
}

#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub use transactional::{TxJob, prepare_tx};

#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
mod transactional {
    use super::{Glue, execute_request, resolve};
    use crate::engine::{Engine, ExecuteRequest};
    use crate::http::capture::Capture;
    use crate::http::config::Config;
    use crate::http::reply::{Reply, Step};
    use crate::http::route::{Route, RoutePolicy};
    use crate::http::{RequestHead, is_safe_method};
    use crate::key::{IdempotencyKey, KeyError};
    use crate::problem::Problem;
    use crate::scope::{Scope, ScopeError};
    use crate::tx::{Halted, Transaction, TxDatabase, TxOptions};
    use bytes::Bytes;
    use std::future::Future;
    use std::marker::PhantomData;

    /// What an adapter does next on a transactional route ([`TxBegin`](crate::tx::TxBegin) on the
    /// wire): run the handler with the execution's transaction, or answer.
    #[derive(Debug)]
    // Made and taken apart once per request: boxing the large variant would only add an allocation.
    #[allow(clippy::large_enum_variant)]
    enum TxStep<DB: crate::tx::TxDatabase> {
        /// Run the handler with this transaction (under [`TxExecution::run`](crate::tx::TxExecution::run)),
        /// read its whole response, then [`finish_transactional`].
        Run(crate::tx::TxExecution<DB>, crate::tx::Transaction<DB>),
        /// Answer with this; the handler does not run.
        Respond(Reply),
    }

    impl<DB: crate::tx::TxDatabase> From<crate::tx::TxBegin<DB>> for TxStep<DB> {
        fn from(begin: crate::tx::TxBegin<DB>) -> Self {
            match begin {
                crate::tx::TxBegin::Run(mut execution) => match execution.transaction() {
                    Some(tx) => TxStep::Run(execution, tx),
                    // A fresh execution always holds its transaction.
                    None => TxStep::Respond(Reply::problem(&Problem::misconfigured())),
                },
                crate::tx::TxBegin::Respond(begin) => match Step::from(begin) {
                    Step::Respond(reply) => TxStep::Respond(reply),
                    // `begin_transactional` never answers with these.
                    Step::Execute(_) | Step::Unprotected => {
                        TxStep::Respond(Reply::problem(&Problem::misconfigured()))
                    }
                },
                // The engine logged which database the route wants and what the store is; the
                // client is told nothing of the server's wiring.
                crate::tx::TxBegin::WrongStore { .. } => {
                    TxStep::Respond(Reply::problem(&Problem::misconfigured()))
                }
            }
        }
    }

    /// Begins a transactional route's request: claimed under `options` when `request` is
    /// protected, or with a transaction and no record (`None`: a safe method, or no key where it
    /// is optional).
    async fn begin_transactional<DB: crate::tx::TxDatabase>(
        engine: &Engine,
        request: Option<crate::engine::ExecuteRequest>,
        policy: &crate::engine::Policy,
        options: &TxOptions,
    ) -> TxStep<DB> {
        let begin = match request {
            Some(request) => {
                engine
                    .begin_transactional::<DB>(request, policy, options)
                    .await
            }
            None => engine.begin_unprotected::<DB>(policy).await,
        };
        TxStep::from(begin)
    }

    /// What the client gets after [`finish_transactional`].
    #[derive(Debug, Clone, PartialEq, Eq)]
    enum TxReply {
        /// Send the handler's response (its body as read); `first_execution`: add
        /// [`FIRST_EXECUTION`](crate::http::reply::FIRST_EXECUTION) (the response was stored).
        Send {
            /// Whether the response was stored with the commit.
            first_execution: bool,
        },
        /// Answer with this instead (the commit failed: nothing of the handler's is sent).
        Respond(Reply),
    }

    /// Finishes a transactional execution with the handler's whole response: stores it (up to
    /// `limit` bytes; larger ones store the oversized marker) and commits, or rolls back when the
    /// route does not store its status. Nothing can be sent before COMMIT, so the adapter reads
    /// the whole body first (a failed body: [`TxExecution::abort`](crate::tx::TxExecution::abort)
    /// and [`Problem::response_failed`]).
    async fn finish_transactional<'a, DB: crate::tx::TxDatabase>(
        execution: crate::tx::TxExecution<DB>,
        status: u16,
        headers: impl IntoIterator<Item = (&'a str, &'a [u8])>,
        body: &[u8],
        limit: usize,
    ) -> TxReply {
        let mut capture = Capture::new(status, headers, limit);
        capture.push(body);
        let protected = execution.is_protected();
        match execution.finish(capture.finish()).await {
            crate::tx::TxFinished::Committed => TxReply::Send {
                first_execution: protected,
            },
            crate::tx::TxFinished::RolledBack => TxReply::Send {
                first_execution: false,
            },
            crate::tx::TxFinished::Failed(_) => {
                TxReply::Respond(Reply::problem(&Problem::store_unavailable()))
            }
            crate::tx::TxFinished::Escaped => {
                TxReply::Respond(Reply::problem(&Problem::misconfigured()))
            }
        }
    }

    /// A transactional route's request, ready to begin ([`TxJob::run`]).
    #[derive(Debug)]
    pub struct TxJob<DB> {
        engine: Engine,
        request: Option<ExecuteRequest>,
        resolved: RoutePolicy,
        options: TxOptions,
        db: PhantomData<fn() -> DB>,
    }

    /// Resolves a transactional route and identifies the request; a safe method or a missing
    /// optional key gets a transaction and no record.
    ///
    /// # Errors
    /// The reply to answer with (a misconfigured route, a scope that cannot be built).
    pub async fn prepare_tx<DB: TxDatabase>(
        config: &Config,
        route: &'static Route,
        head: RequestHead<'_>,
        key: Result<IdempotencyKey, KeyError>,
        body: Bytes,
        scope: Result<Scope, ScopeError>,
    ) -> Result<TxJob<DB>, Reply> {
        let resolved = resolve(route, config)?;
        let options = route.tx_options(config);
        // Safe methods ignore the key; a missing key got here only where it is optional.
        let request = if is_safe_method(head.method) || key.is_err() {
            None
        } else {
            Some(execute_request(&head, key, body, scope).await?)
        };
        Ok(TxJob {
            engine: config.engine().clone(),
            request,
            resolved,
            options,
            db: PhantomData,
        })
    }

    impl<DB: TxDatabase> TxJob<DB> {
        /// Begin → `handler` → store with the commit: the stored response commits with the
        /// handler's writes, and nothing is sent before that commit. Run it detached, as
        /// [`Job::run`](super::Job::run).
        pub async fn run<G, F, Fut>(self, handler: F) -> G::Response
        where
            G: Glue,
            F: FnOnce(Transaction<DB>) -> Fut,
            Fut: Future<Output = G::Response>,
        {
            let policy = &self.resolved.policy;
            let begin =
                begin_transactional::<DB>(&self.engine, self.request, policy, &self.options);
            let (mut execution, tx) = match begin.await {
                TxStep::Respond(reply) => return G::reply(reply),
                TxStep::Run(execution, tx) => (execution, tx),
            };
            let read = execution
                .run(async move {
                    let (head, body) = G::split(handler(tx).await);
                    (head, G::collect(body).await)
                })
                .await;
            let (mut head, body) = match read {
                Ok((head, Ok(body))) => (head, body),
                Ok((_, Err(_))) => {
                    execution.abort().await;
                    return G::reply(Reply::problem(&Problem::response_failed()));
                }
                Err(Halted::OverLease(_)) => {
                    execution.abort().await;
                    return G::reply(Reply::problem(&Problem::handler_timed_out()));
                }
                Err(Halted::Panicked(panic)) => {
                    execution.abort().await;
                    std::panic::resume_unwind(panic)
                }
            };
            let status = G::status(&head);
            let limit = self.resolved.max_response;
            match finish_transactional(execution, status, G::headers(&head), &body, limit).await {
                TxReply::Respond(reply) => G::reply(reply),
                TxReply::Send { first_execution } => {
                    if first_execution {
                        G::mark_first_execution(&mut head);
                    }
                    G::join(head, G::from_bytes(body))
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::read_body;
    use bytes::Bytes;
    use futures_util::stream;

    fn chunks(parts: &[&'static [u8]]) -> Vec<Result<Bytes, &'static str>> {
        parts.iter().map(|p| Ok(Bytes::from_static(p))).collect()
    }

    async fn read(parts: Vec<Result<Bytes, &'static str>>, limit: usize) -> Result<Bytes, u16> {
        read_body(stream::iter(parts), limit)
            .await
            .map_err(|p| p.status)
    }

    #[tokio::test]
    async fn one_chunk_is_the_body_itself_not_a_copy() {
        let chunk = Bytes::from(b"{\"amount\":1}".to_vec());
        let body = read(vec![Ok(chunk.clone())], 64).await.unwrap();
        assert_eq!(body, chunk);
        assert_eq!(body.as_ptr(), chunk.as_ptr(), "the chunk was copied");
    }

    #[tokio::test]
    async fn chunks_are_joined_in_order() {
        let body = read(chunks(&[b"a", b"b", b"c"]), 64).await.unwrap();
        assert_eq!(&body[..], b"abc");
        let body = read(chunks(&[b"ab", b"cd"]), 4).await.unwrap();
        assert_eq!(&body[..], b"abcd");
        let body = read(chunks(&[b"ab", b"", b"cd", b"e"]), 64).await.unwrap();
        assert_eq!(&body[..], b"abcde");
        let body = read(chunks(&[b"", b"xy"]), 64).await.unwrap();
        assert_eq!(&body[..], b"xy");
        assert!(read(Vec::new(), 64).await.unwrap().is_empty());
        assert!(read(chunks(&[b""]), 0).await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn the_limit_holds_for_one_chunk_and_for_many() {
        assert_eq!(read(chunks(&[b"abcd"]), 4).await.unwrap().len(), 4);
        assert_eq!(read(chunks(&[b"abcde"]), 4).await, Err(413));
        assert_eq!(read(chunks(&[b"ab", b"cd"]), 4).await.unwrap().len(), 4);
        assert_eq!(read(chunks(&[b"ab", b"cd", b"e"]), 4).await, Err(413));
        assert_eq!(read(chunks(&[b"abc", b"de"]), 4).await, Err(413));
    }

    #[tokio::test]
    async fn the_route_template_is_asked_for_only_when_a_key_is_refused() {
        use super::admit;
        use crate::{engine::Engine, http::Config, store::MemoryStore};
        let config = Config::new(Engine::new(MemoryStore::new()));
        let asked = std::cell::Cell::new(0);
        let template = || {
            asked.set(asked.get() + 1);
            Some("/t")
        };
        let none: [&[u8]; 0] = [];
        // A valid key, a safe method, no key on an optional route: never asked.
        assert!(admit(&config, true, "POST", [&b"k1"[..]], None, template).is_ok());
        assert!(admit(&config, true, "GET", none, None, template).is_ok());
        assert!(admit(&config, false, "POST", none, None, template).is_ok());
        assert_eq!(asked.get(), 0);
        // No key where one is required, and a malformed key: refused, asked once each.
        let refused = |keys: &[&[u8]]| {
            admit(&config, true, "POST", keys.iter().copied(), None, template)
                .map(|_| ())
                .map_err(|p| p.status)
        };
        assert_eq!(refused(&[]), Err(400));
        assert_eq!(refused(&[b"a b"]), Err(400));
        assert_eq!(asked.get(), 2);
    }

    #[tokio::test]
    async fn a_broken_stream_is_400_wherever_it_breaks() {
        assert_eq!(read(vec![Err("reset")], 64).await, Err(400));
        let mut parts = chunks(&[b"ab"]);
        parts.push(Err("reset"));
        assert_eq!(read(parts, 64).await, Err(400));
        let mut parts = chunks(&[b"ab", b"cd"]);
        parts.push(Err("reset"));
        assert_eq!(read(parts, 64).await, Err(400));
    }
}
