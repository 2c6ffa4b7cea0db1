//! Responses: the library's own replies as axum responses, and the handler's response passed
//! to the client while a bounded copy of it is stored.

use axum::body::{Body, Bytes, HttpBody};
use axum::http::{HeaderName, HeaderValue, StatusCode, response::Parts};
use axum::response::Response;
use http_body::{Frame, SizeHint};
use http_body_util::BodyExt;
use idempotent_core::__private::driver::{self, Glue, Tee};
use idempotent_core::__private::{FIRST_EXECUTION, Recorder, Reply};
use idempotent_core::Problem;
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

/// `Idempotent-Replayed`, made in a const so that it holds the static name: one made from a
/// `&str` copies a name that is not a standard one into a new allocation every time.
const REPLAYED: HeaderName = HeaderName::from_static(FIRST_EXECUTION.0);

/// A core [`Reply`] as a response (headers that are not valid HTTP are skipped). Nothing is
/// copied: the body and each stored header value are moved into the response, a static value
/// is borrowed.
pub(crate) fn reply(r: Reply) -> Response {
    let mut res = Response::new(Body::from(r.body));
    *res.status_mut() = StatusCode::from_u16(r.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let headers = res.headers_mut();
    headers.reserve(r.headers.len());
    for (name, value) in r.headers {
        let name = if name == REPLAYED.as_str() {
            Ok(REPLAYED)
        } else {
            HeaderName::from_bytes(name.as_bytes())
        };
        if let (Ok(n), Ok(v)) = (name, HeaderValue::from_maybe_shared(Reply::shared(value))) {
            headers.append(n, v);
        }
    }
    res
}

/// Axum's side of the request driver.
pub(crate) struct Axum;

impl Glue for Axum {
    type Response = Response;
    type Head = Parts;
    type Body = Body;
    type Error = axum::Error;

    fn reply(r: Reply) -> Response {
        reply(r)
    }

    fn split(response: Response) -> (Parts, Body) {
        response.into_parts()
    }

    fn join(head: Parts, body: Body) -> Response {
        Response::from_parts(head, body)
    }

    fn status(head: &Parts) -> u16 {
        head.status.as_u16()
    }

    fn headers(head: &Parts) -> impl Iterator<Item = (&str, &[u8])> {
        head.headers.iter().map(|(n, v)| (n.as_str(), v.as_bytes()))
    }

    fn mark_first_execution(head: &mut Parts) {
        head.headers
            .insert(REPLAYED, HeaderValue::from_static(FIRST_EXECUTION.1));
    }

    fn exact_len(body: &Body) -> Option<u64> {
        body.size_hint().exact()
    }

    async fn collect(body: Body) -> Result<Bytes, axum::Error> {
        Ok(body.collect().await?.to_bytes())
    }

    fn from_bytes(bytes: Bytes) -> Body {
        Body::from(bytes)
    }

    fn tee(body: Body, recorder: Recorder) -> Body {
        Body::new(TeeBody {
            inner: body,
            tee: Tee::new(recorder),
        })
    }
}

/// The handler's streamed body on its way to the client, recorded frame by frame ([`Tee`]).
struct TeeBody {
    inner: Body,
    tee: Tee,
}

impl HttpBody for TeeBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = self.get_mut();
        let inner = &mut this.inner;
        this.tee.poll_next(
            cx,
            |cx| Pin::new(&mut *inner).poll_frame(cx),
            |frame| frame.data_ref().map(|data| &data[..]),
        )
    }

    fn is_end_stream(&self) -> bool {
        self.tee.is_passthrough() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for TeeBody {
    fn drop(&mut self) {
        // The client went away mid-stream: read on, so the outcome is stored.
        if let Some(recorder) = self.tee.dropped() {
            let rest = std::mem::take(&mut self.inner).into_data_stream();
            driver::spawn(recorder.abandon(rest));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::StreamExt;
    use idempotent_core::{
        Engine, IdempotencyKey, MemoryStore, Scope, Store, engine::Begin, engine::ExecuteRequest,
        engine::Policy, fingerprint::Fingerprint, fingerprint::FingerprintInput, store::RecordKey,
        store::RecordState, store::StoredOutcome,
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
        let response = Response::new(Body::from_stream(stream));
        let response = driver::finish::<Axum>(execution, response, 1024).await;
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
