//! Responses: the library's own replies as actix responses, and the handler's response passed
//! to the client while a bounded copy of it is stored.

use actix_web::body::{BodySize, BoxBody, MessageBody};
use actix_web::http::StatusCode;
use actix_web::http::header::{HeaderName, HeaderValue};
use actix_web::web::Bytes;
use actix_web::{HttpResponse, ResponseError};
use idempotent_core::http::{Capture, FIRST_EXECUTION, Recorder, Reply, ResponsePlan};
use idempotent_core::{Execution, Problem, Recorded, StoredOutcome};
use std::future::Future;
use std::pin::Pin;
use std::task::{Context as TaskContext, Poll};

/// Renders a problem as `application/problem+json` with `Cache-Control: no-store` (and
/// `Retry-After` when it has one), exactly as the library's own failures are answered.
///
/// ```
/// use idempotent_actix::{Problem, problem};
/// let res = problem(&Problem::store_unavailable());
/// assert_eq!(res.status(), 503);
/// assert_eq!(res.headers().get("content-type").unwrap(), "application/problem+json");
/// assert_eq!(res.headers().get("retry-after").unwrap(), "1");
/// ```
pub fn problem(p: &Problem) -> HttpResponse {
    reply(Reply::problem(p))
}

/// A core [`Reply`] as a response (headers that are not valid HTTP are skipped).
pub(crate) fn reply(r: Reply) -> HttpResponse {
    let status = StatusCode::from_u16(r.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut res = HttpResponse::with_body(status, r.body).map_into_boxed_body();
    let headers = res.headers_mut();
    for (name, value) in r.headers {
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_bytes(&value),
        ) {
            headers.append(n, v);
        }
    }
    res
}

/// A problem as an extractor's error: actix answers with exactly the problem's response.
#[derive(Debug)]
pub struct ProblemError(Problem);

impl ProblemError {
    pub(crate) fn new(p: Problem) -> Self {
        ProblemError(p)
    }
}

impl std::fmt::Display for ProblemError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.0.type_uri(), self.0.status)
    }
}

impl ResponseError for ProblemError {
    fn status_code(&self) -> StatusCode {
        StatusCode::from_u16(self.0.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }

    fn error_response(&self) -> HttpResponse {
        problem(&self.0)
    }
}

/// Finishes a claimed execution with the handler's response and returns what the client gets,
/// following the core's [`ResponsePlan`]; a streamed body goes through a [`TeeBody`].
pub(crate) async fn finish(
    execution: Execution,
    response: HttpResponse,
    limit: usize,
) -> HttpResponse {
    let (mut response, body) = response.into_parts();
    let status = response.status().as_u16();
    let exact = match body.size() {
        BodySize::None => Some(0),
        BodySize::Sized(n) => Some(n),
        BodySize::Stream => None,
    };
    let plan = ResponsePlan::new(execution.policy(), status, exact, limit);
    let capture = |response: &HttpResponse<()>| {
        Capture::new(
            status,
            response
                .headers()
                .iter()
                .map(|(n, v)| (n.as_str(), v.as_bytes())),
            limit,
        )
    };
    let body = match plan {
        ResponsePlan::Release => {
            execution.release().await;
            return response.set_body(body);
        }
        ResponsePlan::Collect => {
            let mut recorder = Recorder::new(execution, capture(&response));
            match recorder.run(actix_web::body::to_bytes(body)).await {
                Ok(Ok(bytes)) => {
                    recorder.data(&bytes);
                    recorder.end().await;
                    BoxBody::new(bytes)
                }
                Ok(Err(error)) => {
                    let reason = error.to_string();
                    recorder.fail(&reason).await;
                    return problem(&Problem::response_failed());
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
            let recorder = Recorder::streaming(execution, capture(&response));
            BoxBody::new(TeeBody {
                inner: Some(body),
                state: Tee::Recording(Box::new(recorder)),
            })
        }
    };
    response.headers_mut().insert(
        HeaderName::from_static(FIRST_EXECUTION.0),
        HeaderValue::from_static(FIRST_EXECUTION.1),
    );
    response.set_body(body)
}

/// The handler's streamed body on its way to the client, fed to a [`Recorder`] chunk by chunk
/// (see there for the ends it can take). Work it hands off (storing the marker, releasing,
/// reading on after the client left) runs on the worker's runtime.
struct TeeBody {
    inner: Option<BoxBody>,
    state: Tee,
}

enum Tee {
    Recording(Box<Recorder>),
    Finishing(Pin<Box<dyn Future<Output = Recorded>>>),
    Passthrough,
}

/// Takes the recorder out of a recording state, leaving the body to pass through.
fn take_recorder(state: &mut Tee) -> Recorder {
    match std::mem::replace(state, Tee::Passthrough) {
        Tee::Recording(recorder) => *recorder,
        _ => unreachable!("only called while recording"),
    }
}

type BodyError = Box<dyn std::error::Error>;

impl MessageBody for TeeBody {
    type Error = BodyError;

    fn size(&self) -> BodySize {
        self.inner
            .as_ref()
            .map_or(BodySize::None, MessageBody::size)
    }

    fn poll_next(
        self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
    ) -> Poll<Option<Result<Bytes, BodyError>>> {
        let this = self.get_mut();
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        loop {
            match &mut this.state {
                Tee::Passthrough => return Pin::new(&mut *inner).poll_next(cx),
                Tee::Finishing(store) => {
                    std::task::ready!(store.as_mut().poll(cx));
                    this.state = Tee::Passthrough;
                    return Poll::Ready(None);
                }
                Tee::Recording(recorder) => {
                    if recorder.poll_expired(cx).is_ready() {
                        // Still streaming a lease later: not replayable; the rest goes through.
                        spawn(take_recorder(&mut this.state).over_limit());
                        continue;
                    }
                    match std::task::ready!(Pin::new(&mut *inner).poll_next(cx)) {
                        Some(Ok(chunk)) => {
                            if !recorder.data(&chunk) {
                                spawn(take_recorder(&mut this.state).over_limit());
                            }
                            return Poll::Ready(Some(Ok(chunk)));
                        }
                        Some(Err(error)) => {
                            let recorder = take_recorder(&mut this.state);
                            let reason = error.to_string();
                            spawn(async move { recorder.fail(&reason).await });
                            return Poll::Ready(Some(Err(error)));
                        }
                        None => {
                            // Stored before the end of the stream is passed on.
                            this.state =
                                Tee::Finishing(Box::pin(take_recorder(&mut this.state).end()));
                        }
                    }
                }
            }
        }
    }
}

impl Drop for TeeBody {
    fn drop(&mut self) {
        match std::mem::replace(&mut self.state, Tee::Passthrough) {
            Tee::Passthrough => {}
            // The client has every byte; storing them must not be cut short.
            Tee::Finishing(store) => spawn(store),
            // The client went away mid-stream: read on, so the outcome is stored.
            Tee::Recording(recorder) => {
                if let Some(mut body) = self.inner.take() {
                    let rest =
                        futures_util::stream::poll_fn(move |cx| Pin::new(&mut body).poll_next(cx));
                    spawn(recorder.abandon(rest));
                }
            }
        }
    }
}

/// Spawns the rest of an execution's work onto the worker's runtime (actix runs handlers on a
/// per-worker local runtime, and these futures need not be `Send`); outside one, the record
/// stays in progress until its lease ends.
pub(crate) fn spawn(work: impl Future<Output = Recorded> + 'static) {
    // Actix's worker and system threads run a local task set (where `spawn` may be called).
    if actix_rt::Arbiter::try_current().is_some() {
        drop(actix_rt::spawn(work));
    } else {
        tracing::warn!(
            "idempotency: no runtime to finish a response on; its record stays in progress until its lease ends"
        );
    }
}
