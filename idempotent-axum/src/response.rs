//! Responses: the library's own replies as axum responses, and the handler's response passed
//! to the client while a bounded copy of it is stored.

use axum::body::{Body, Bytes, HttpBody};
use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::response::Response;
use http_body::{Frame, SizeHint};
use http_body_util::BodyExt;
use idempotent_core::http::{Capture, FIRST_EXECUTION, Reply};
use idempotent_core::{Execution, Problem, StoredOutcome};
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

/// Finishes a claimed execution with the handler's response and returns what the client gets.
///
/// - A status the route does not store (5xx, 408/409/425/429): the key is released first, the
///   response goes out untouched.
/// - A body of known size within the limit (the usual JSON response, already in memory): read
///   whole, stored, then sent, so a client that got it can retry and get the replay.
/// - A body known to be over the limit: the oversized marker is stored, the body streams.
/// - A body of unknown size (a stream): it streams to the client as produced while a copy of
///   at most `limit + 1` bytes is kept ([`TeeBody`]); see there for the ends it can take.
pub(crate) async fn finish(mut execution: Execution, response: Response, limit: usize) -> Response {
    let (mut parts, body) = response.into_parts();
    let status = parts.status.as_u16();
    if !execution.policy().stores(status) {
        execution.release().await;
        return Response::from_parts(parts, body);
    }
    let mut capture = Capture::new(
        status,
        parts
            .headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_bytes())),
        limit,
    );
    parts.headers.insert(
        FIRST_EXECUTION.0,
        HeaderValue::from_static(FIRST_EXECUTION.1),
    );
    match body.size_hint().exact() {
        Some(size) if size <= limit as u64 => match execution.run(body.collect()).await {
            Ok(Ok(collected)) => {
                let bytes = collected.to_bytes();
                capture.push(&bytes);
                execution.finish(capture.finish()).await;
                Response::from_parts(parts, Body::from(bytes))
            }
            Ok(Err(error)) => {
                tracing::error!(error = %error, "idempotency: the handler's response body failed; the key is released");
                execution.release().await;
                body_failed()
            }
            Err(panic) => {
                execution.release().await;
                std::panic::resume_unwind(panic)
            }
        },
        Some(size) => {
            execution
                .finish(StoredOutcome::Oversized { status, size })
                .await;
            Response::from_parts(parts, body)
        }
        None => Response::from_parts(
            parts,
            Body::new(TeeBody {
                inner: body,
                state: Tee::Capturing(Box::new((capture, execution))),
            }),
        ),
    }
}

fn body_failed() -> Response {
    problem(&Problem::misconfigured(
        "the handler's response body failed before it could be sent; nothing was stored, retry with the same key",
    ))
}

/// The handler's streamed body on its way to the client, copied up to the route's limit.
///
/// - It ends within the limit: the copy is stored before the end of the stream is passed on.
/// - It passes the limit: the oversized marker is stored (in a task) and the rest streams
///   through uncopied; a later error leaves the marker (the handler ran).
/// - It fails before either: nothing is stored and the key is released.
/// - The client goes away first (this body is dropped): the rest is read in a task, as far as
///   the limit, and stored the same way, so a retry gets the replay, never a second run.
pub(crate) struct TeeBody {
    inner: Body,
    state: Tee,
}

enum Tee {
    Capturing(Box<(Capture, Execution)>),
    Finishing(Pin<Box<dyn Future<Output = ()> + Send>>),
    Passthrough,
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
                Tee::Capturing(tee) => {
                    tee.1.poll_heartbeat(cx);
                    let frame = std::task::ready!(Pin::new(&mut this.inner).poll_frame(cx));
                    match frame {
                        Some(Ok(frame)) => {
                            let within = frame.data_ref().is_none_or(|data| tee.0.push(data));
                            if !within {
                                let Tee::Capturing(tee) =
                                    std::mem::replace(&mut this.state, Tee::Passthrough)
                                else {
                                    unreachable!("matched above")
                                };
                                let (capture, execution) = *tee;
                                spawn(async move {
                                    execution.finish(capture.finish()).await;
                                });
                            }
                            return Poll::Ready(Some(Ok(frame)));
                        }
                        Some(Err(error)) => {
                            tracing::error!(error = %error, "idempotency: the handler's response stream failed before it could be stored; the key is released");
                            let Tee::Capturing(tee) =
                                std::mem::replace(&mut this.state, Tee::Passthrough)
                            else {
                                unreachable!("matched above")
                            };
                            let (_, execution) = *tee;
                            spawn(async move {
                                execution.release().await;
                            });
                            return Poll::Ready(Some(Err(error)));
                        }
                        None => {
                            let Tee::Capturing(tee) =
                                std::mem::replace(&mut this.state, Tee::Passthrough)
                            else {
                                unreachable!("matched above")
                            };
                            let (capture, execution) = *tee;
                            this.state = Tee::Finishing(Box::pin(async move {
                                execution.finish(capture.finish()).await;
                            }));
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
            Tee::Finishing(store) => {
                // The client has every byte; storing them must not be cut short.
                spawn(store);
            }
            Tee::Capturing(tee) => {
                // The client went away mid-stream: read on, so the outcome is stored.
                let (mut capture, mut execution) = *tee;
                let mut body = std::mem::take(&mut self.inner);
                spawn(async move {
                    let drained = execution
                        .run(async {
                            while let Some(frame) = body.frame().await {
                                let frame = frame?;
                                if let Some(data) = frame.data_ref()
                                    && !capture.push(data)
                                {
                                    break;
                                }
                            }
                            Ok::<(), axum::Error>(())
                        })
                        .await;
                    match drained {
                        Ok(Ok(())) => {
                            execution.finish(capture.finish()).await;
                        }
                        Ok(Err(error)) => {
                            tracing::error!(error = %error, "idempotency: the handler's response stream failed after its client left; the key is released");
                            execution.release().await;
                        }
                        Err(_panic) => {
                            execution.release().await;
                        }
                    }
                });
            }
        }
    }
}

/// Spawns the rest of an execution's work onto the current runtime; outside one (a runtime
/// shutting down) the record stays in progress until its lease ends.
fn spawn(work: impl Future<Output = ()> + Send + 'static) {
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
