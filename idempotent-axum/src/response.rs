//! Responses: the library's own replies as axum responses, and the handler's response passed
//! to the client while a bounded copy of it is stored.

use axum::body::{Body, Bytes, HttpBody};
use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::response::Response;
use http_body::{Frame, SizeHint};
use http_body_util::BodyExt;
use idempotent_core::http::{Capture, FIRST_EXECUTION, Recorder, Reply, ResponsePlan};
use idempotent_core::{Execution, Problem, Recorded, StoredOutcome};
use std::future::Future;
use std::pin::Pin;
use std::task::{Context as TaskContext, Poll};

/// Renders a problem as `application/problem+json` with `Cache-Control: no-store` (and
/// `Retry-After` when it has one), exactly as the library's own failures are answered.
///
/// ```
/// use idempotent_axum::{Problem, problem};
/// let res = problem(&Problem::store_unavailable());
/// assert_eq!(res.status(), 503);
/// assert_eq!(res.headers()["content-type"], "application/problem+json");
/// assert_eq!(res.headers()["retry-after"], "1");
/// ```
pub fn problem(p: &Problem) -> Response {
    reply(Reply::problem(p))
}

/// A core [`Reply`] as a response (headers that are not valid HTTP are skipped).
pub(crate) fn reply(r: Reply) -> Response {
    let mut res = Response::new(Body::from(r.body));
    *res.status_mut() = StatusCode::from_u16(r.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let headers = res.headers_mut();
    headers.reserve(r.headers.len());
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

/// Finishes a claimed execution with the handler's response and returns what the client gets,
/// following the core's [`ResponsePlan`]; a streamed body goes through a [`TeeBody`].
pub(crate) async fn finish(execution: Execution, response: Response, limit: usize) -> Response {
    let (mut parts, body) = response.into_parts();
    let status = parts.status.as_u16();
    let plan = ResponsePlan::new(execution.policy(), status, body.size_hint().exact(), limit);
    let capture = || {
        Capture::new(
            status,
            parts
                .headers
                .iter()
                .map(|(n, v)| (n.as_str(), v.as_bytes())),
            limit,
        )
    };
    let body = match plan {
        ResponsePlan::Release => {
            execution.release().await;
            return Response::from_parts(parts, body);
        }
        ResponsePlan::Collect => {
            let mut recorder = Recorder::new(execution, capture());
            match recorder.run(body.collect()).await {
                Ok(Ok(collected)) => {
                    let bytes = collected.to_bytes();
                    recorder.data(&bytes);
                    recorder.end().await;
                    Body::from(bytes)
                }
                Ok(Err(error)) => {
                    recorder.fail(&error).await;
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
        ResponsePlan::Stream => Body::new(TeeBody {
            inner: body,
            state: Tee::Recording(Box::new(Recorder::streaming(execution, capture()))),
        }),
    };
    parts.headers.insert(
        FIRST_EXECUTION.0,
        HeaderValue::from_static(FIRST_EXECUTION.1),
    );
    Response::from_parts(parts, body)
}

/// The handler's streamed body on its way to the client, fed to a [`Recorder`] frame by frame
/// (see there for the ends it can take). Spawned work (storing the marker, releasing, reading
/// on after the client left) runs on the current runtime.
pub(crate) struct TeeBody {
    inner: Body,
    state: Tee,
}

enum Tee {
    Recording(Box<Recorder>),
    Finishing(Pin<Box<dyn Future<Output = Recorded> + Send>>),
    Passthrough,
}

/// Takes the recorder out of a recording state, leaving the body to pass through.
fn take_recorder(state: &mut Tee) -> Recorder {
    match std::mem::replace(state, Tee::Passthrough) {
        Tee::Recording(recorder) => *recorder,
        _ => unreachable!("only called while recording"),
    }
}

impl HttpBody for TeeBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = self.get_mut();
        loop {
            match &mut this.state {
                Tee::Passthrough => return Pin::new(&mut this.inner).poll_frame(cx),
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
                    match std::task::ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
                        Some(Ok(frame)) => {
                            let within = frame.data_ref().is_none_or(|data| recorder.data(data));
                            if !within {
                                spawn(take_recorder(&mut this.state).over_limit());
                            }
                            return Poll::Ready(Some(Ok(frame)));
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

    fn is_end_stream(&self) -> bool {
        matches!(self.state, Tee::Passthrough) && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
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
                let rest = std::mem::take(&mut self.inner).into_data_stream();
                spawn(recorder.abandon(rest));
            }
        }
    }
}

/// Spawns the rest of an execution's work onto the current runtime; outside one (a runtime
/// shutting down) the record stays in progress until its lease ends.
fn spawn(work: impl Future<Output = Recorded> + Send + 'static) {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => drop(runtime.spawn(work)),
        Err(_) => tracing::warn!(
            "idempotency: no runtime to finish a response on; its record stays in progress until its lease ends"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::StreamExt;
    use idempotent_core::{
        Begin, Engine, ExecuteRequest, Fingerprint, FingerprintInput, IdempotencyKey, MemoryStore,
        Policy, RecordKey, RecordState, Scope, Store,
    };
    use std::sync::Arc;
    use std::time::Duration;

    fn request() -> ExecuteRequest {
        ExecuteRequest {
            scope: Scope::new("acct").expect("scope"),
            key: IdempotencyKey::parse(b"k"),
            fingerprint: Fingerprint::compute(&FingerprintInput {
                method: "POST",
                path: "/s",
                query: None,
                content_type: None,
                body: b"",
            }),
        }
    }

    /// The client leaves after the first chunk (the body is dropped): the rest of the stream
    /// is read in the background and the whole response stored.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dropped_stream_is_read_to_the_end_and_stored() {
        let store = MemoryStore::new();
        let engine = Engine::new(store.clone());
        let Begin::Claimed(execution) = engine.begin(request(), &Policy::default()).await else {
            panic!("not claimed")
        };
        let gate = Arc::new(tokio::sync::Notify::new());
        let opened = gate.clone();
        let stream = futures_util::stream::iter([Ok::<_, std::io::Error>("first;")]).chain(
            futures_util::stream::once(async move {
                opened.notified().await;
                Ok("second")
            }),
        );
        let response = finish(execution, Response::new(Body::from_stream(stream)), 1024).await;
        assert_eq!(response.headers()["idempotent-replayed"], "false");
        let mut body = response.into_body();
        let first = body.frame().await.expect("a frame").expect("data");
        assert_eq!(first.into_data().expect("data"), "first;");
        drop(body);
        assert_eq!(engine.running(), 1, "still running without its client");
        gate.notify_one();
        for _ in 0..200 {
            if engine.running() == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let key = RecordKey::new(
            Scope::new("acct").expect("scope"),
            IdempotencyKey::parse(b"k").expect("key"),
        );
        match store.get(&key).await.expect("get").map(|r| r.state) {
            Some(RecordState::Done {
                outcome: StoredOutcome::Response(r),
                ..
            }) => assert_eq!(r.body, b"first;second"),
            other => panic!("{other:?}"),
        }
    }
}
