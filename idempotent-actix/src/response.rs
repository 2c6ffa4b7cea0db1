//! Responses: the library's own replies as actix responses, and the handler's response passed
//! to the client while a bounded copy of it is stored.

use actix_web::body::{BodySize, BoxBody, MessageBody};
use actix_web::http::StatusCode;
use actix_web::http::header::{HeaderName, HeaderValue};
use actix_web::web::Bytes;
use actix_web::{HttpResponse, ResponseError};
use idempotent_core::__private::driver::{Glue, Tee, no_runtime};
use idempotent_core::__private::{FIRST_EXECUTION, Recorder, Reply};
use idempotent_core::Problem;
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

/// `Idempotent-Replayed`, made in a const so that it holds the static name: one made from a
/// `&str` copies a name that is not a standard one into a new allocation every time.
const REPLAYED: HeaderName = HeaderName::from_static(FIRST_EXECUTION.0);

/// A core [`Reply`] as a response (headers that are not valid HTTP are skipped). Nothing is
/// copied: the body and each stored header value are moved into the response, a static value
/// is borrowed.
pub(crate) fn reply(r: Reply) -> HttpResponse {
    let status = StatusCode::from_u16(r.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut res = HttpResponse::with_body(status, r.body).map_into_boxed_body();
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

/// Actix's side of the request driver.
pub(crate) struct Actix;

impl Glue for Actix {
    type Response = HttpResponse;
    type Head = HttpResponse<()>;
    type Body = BoxBody;
    type Error = Box<dyn std::error::Error>;

    fn reply(r: Reply) -> HttpResponse {
        reply(r)
    }

    fn split(response: HttpResponse) -> (HttpResponse<()>, BoxBody) {
        response.into_parts()
    }

    fn join(head: HttpResponse<()>, body: BoxBody) -> HttpResponse {
        head.set_body(body)
    }

    fn status(head: &HttpResponse<()>) -> u16 {
        head.status().as_u16()
    }

    fn headers(head: &HttpResponse<()>) -> impl Iterator<Item = (&str, &[u8])> {
        head.headers()
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_bytes()))
    }

    fn mark_first_execution(head: &mut HttpResponse<()>) {
        head.headers_mut()
            .insert(REPLAYED, HeaderValue::from_static(FIRST_EXECUTION.1));
    }

    fn exact_len(body: &BoxBody) -> Option<u64> {
        match body.size() {
            BodySize::None => Some(0),
            BodySize::Sized(n) => Some(n),
            BodySize::Stream => None,
        }
    }

    fn collect(body: BoxBody) -> impl Future<Output = Result<Bytes, Self::Error>> {
        actix_web::body::to_bytes(body)
    }

    fn from_bytes(bytes: Bytes) -> BoxBody {
        BoxBody::new(bytes)
    }

    fn tee(body: BoxBody, recorder: Recorder) -> BoxBody {
        BoxBody::new(TeeBody {
            inner: Some(body),
            tee: Tee::new(recorder),
        })
    }
}

/// The handler's streamed body on its way to the client, recorded chunk by chunk ([`Tee`]).
struct TeeBody {
    inner: Option<BoxBody>,
    tee: Tee,
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
        this.tee.poll_next(
            cx,
            |cx| Pin::new(&mut *inner).poll_next(cx),
            |chunk| Some(&chunk[..]),
        )
    }
}

impl Drop for TeeBody {
    fn drop(&mut self) {
        // The client went away mid-stream: read on, so the outcome is stored. Actix runs
        // handlers on its worker's local runtime, and this body need not be `Send`.
        if let (Some(recorder), Some(mut body)) = (self.tee.dropped(), self.inner.take()) {
            let rest = futures_util::stream::poll_fn(move |cx| Pin::new(&mut body).poll_next(cx));
            if actix_rt::Arbiter::try_current().is_some() {
                drop(actix_rt::spawn(recorder.abandon(rest)));
            } else {
                no_runtime();
            }
        }
    }
}
