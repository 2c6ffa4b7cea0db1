//! The client side of [idempotent](https://docs.rs/idempotent-core): a
//! [`reqwest-middleware`](reqwest_middleware) middleware that makes one `Idempotency-Key` per
//! logical request and retries with it. It depends on neither the server crates nor sqlx.
//!
//! A retry loop that makes a fresh key on every attempt defeats the mechanism: the server
//! cannot tell the retry from a new request and runs it again. [`IdempotentRetry`] adds the key
//! **once**, before the first attempt, to every request whose method is not safe (POST, PUT,
//! PATCH, DELETE, …) unless the caller set one, and sends every attempt with it. It retries
//! what a retry can fix:
//!
//! - connection errors, timeouts, and connections that broke before the whole response
//!   arrived (the server may have run the request: the key makes the retry a replay; for
//!   safe methods, whose responses are not buffered, a body cut short is the caller's error);
//! - `409 Conflict` (the first attempt still runs), `429 Too Many Requests`, `408`, `425` and
//!   every `5xx`, waiting at least what `Retry-After` asks (seconds or an HTTP date);
//!
//! and never a `4xx` that would fail again (400, 401, 403, 404, 422, …), nor a response the
//! server marks `Idempotent-Replayed: true` (a stored answer, the same on every retry). Waits
//! grow exponentially with **full jitter** (uniform between zero and the exponential bound,
//! from [`retry_policies`]), within a maximum number of attempts and a total deadline that
//! also bounds each attempt in flight. When it gives up between attempts it returns the last
//! response (a 409 or 5xx, for the caller to see) or the last error; when the deadline passes
//! during an attempt, the error is [`DeadlineExceeded`] (a middleware error).
//!
//! Safe methods (GET, HEAD, OPTIONS, TRACE) get no key and are retried on the same statuses and
//! transport errors. When the middleware gives up with an error, the key it made is lost with
//! it: if your code may retry the operation after that, set your own `Idempotency-Key` (kept
//! with the operation) and the middleware uses it. Retrying
//! a POST is safe only against a server that honours the key (this crate's adapters, Stripe,
//! …): against one that ignores it, a lost response means a second execution. Put this
//! middleware **innermost**: another retry middleware wrapped around it would call it afresh
//! for each of its own attempts, and so make a new key for each.
//!
//! ```no_run
//! use idempotent_client::IdempotentRetry;
//! use std::time::Duration;
//!
//! # async fn run() -> Result<(), reqwest_middleware::Error> {
//! let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
//!     .with(
//!         IdempotentRetry::builder()
//!             .max_attempts(8)
//!             .deadline(Duration::from_secs(30))
//!             .build(),
//!     )
//!     .build();
//! // One logical charge: every attempt carries the same generated key.
//! let charge = client
//!     .post("http://127.0.0.1:3000/v1/charges")
//!     .bearer_auth("acct_1")
//!     .header("content-type", "application/json")
//!     .body(r#"{"amount": 500, "currency": "usd", "customer": "cus_1"}"#)
//!     .send()
//!     .await?;
//! // The key it used, for your logs.
//! let key = charge.extensions().get::<idempotent_client::UsedKey>();
//! # let _ = key;
//! # Ok(()) }
//! ```
//!
//! A request whose body cannot be cloned (a stream) is sent once, with its key, and not
//! retried. Responses to keyed requests (unsafe methods) are read in full inside the
//! middleware, within the deadline, so a connection cut in the middle of the body is retried
//! too; idempotent POST answers are small. At most
//! [`IdempotentRetryBuilder::max_buffered`] bytes of a body are held (default
//! [`DEFAULT_MAX_BUFFERED`]): a larger body (by its `Content-Length`, or once that much has
//! come) is handed on as it streams, whole, and a cut in it past that point is the caller's
//! error. Turn buffering off with [`IdempotentRetryBuilder::buffer_responses`]; responses to
//! safe methods are never buffered.
#![cfg_attr(docsrs, feature(doc_cfg))]
#![forbid(unsafe_code)]

use http::Extensions;
use http::header::{HeaderName, HeaderValue, RETRY_AFTER};
use reqwest::{Request, Response, StatusCode};
use reqwest_middleware::{Middleware, Next};
use retry_policies::policies::ExponentialBackoff;
use retry_policies::{Jitter, RetryDecision, RetryPolicy};
use std::time::{Duration, SystemTime};
use tokio::time::Instant;

/// The request header the key travels in (the server side names the same header
/// `idempotent_core::http::IDEMPOTENCY_KEY`; a test in the workspace checks they agree).
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The response header a server of this family sets on a stored answer (`true`): such an
/// answer is the same on every retry, so it is never retried (the server side's
/// `idempotent_core::http::IDEMPOTENT_REPLAYED`).
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// The key a request was sent with, in its response's extensions (absent for safe methods).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsedKey(pub String);

/// How the generated key is written in the `Idempotency-Key` header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum KeyFormat {
    /// A bare UUID, as Stripe and most providers take it (`Idempotency-Key: 5f3c…`). Servers
    /// following the IETF draft (this crate's among them) accept it too.
    #[default]
    Bare,
    /// An RFC 8941 string, as the IETF draft writes it (`Idempotency-Key: "5f3c…"`).
    SfString,
}

/// The retry middleware; build it with [`IdempotentRetry::builder`] (or `default()`: 5
/// attempts, waits from 100 ms up to 10 s, a 30 s deadline).
#[derive(Debug, Clone)]
pub struct IdempotentRetry {
    backoff: ExponentialBackoff,
    max_attempts: u32,
    deadline: Duration,
    format: KeyFormat,
    buffer: bool,
    max_buffered: usize,
    max_retry_after: Duration,
}

/// Default for [`IdempotentRetryBuilder::max_buffered`]: 8 MiB.
pub const DEFAULT_MAX_BUFFERED: usize = 8 << 20;

impl Default for IdempotentRetry {
    fn default() -> Self {
        IdempotentRetry::builder().build()
    }
}

/// Builds an [`IdempotentRetry`].
#[derive(Debug, Clone)]
#[must_use = "call `.build()`"]
pub struct IdempotentRetryBuilder {
    min_wait: Duration,
    max_wait: Duration,
    max_attempts: u32,
    deadline: Duration,
    format: KeyFormat,
    buffer: bool,
    max_buffered: usize,
    max_retry_after: Duration,
}

impl IdempotentRetry {
    /// A builder with the defaults.
    pub fn builder() -> IdempotentRetryBuilder {
        IdempotentRetryBuilder {
            min_wait: Duration::from_millis(100),
            max_wait: Duration::from_secs(10),
            max_attempts: 5,
            deadline: Duration::from_secs(30),
            format: KeyFormat::Bare,
            buffer: true,
            max_buffered: DEFAULT_MAX_BUFFERED,
            max_retry_after: Duration::from_secs(60),
        }
    }
}

impl IdempotentRetryBuilder {
    /// The exponential bounds of the waits: the first retry waits up to `min`, each later one
    /// up to twice the previous bound, never more than `max` (full jitter: a uniform draw
    /// below the bound). Default 100 ms and 10 s; both are capped at one day.
    pub fn backoff(mut self, min: Duration, max: Duration) -> Self {
        // The backoff multiplies `min` by up to `u32::MAX`; a day keeps that far from overflow.
        const CAP: Duration = Duration::from_secs(86_400);
        self.min_wait = min.min(CAP);
        self.max_wait = max.min(CAP).max(self.min_wait);
        self
    }

    /// At most this many attempts in all, the first included (default 5; at least 1).
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = n.max(1);
        self
    }

    /// The whole logical request, waits and attempts included, ends within this (default
    /// 30 s): an attempt still in flight then is abandoned with [`DeadlineExceeded`], and a
    /// wait that would pass it is not started. `Duration::MAX` means no deadline.
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    /// How the generated key is written (default [`KeyFormat::Bare`]).
    pub fn key_format(mut self, format: KeyFormat) -> Self {
        self.format = format;
        self
    }

    /// Whether responses to keyed requests (unsafe methods) are read in full before they are
    /// returned, so that a body cut short is retried too (default `true`). With `false` the
    /// response is returned as soon as its head arrives, and a body that breaks is the
    /// caller's error.
    pub fn buffer_responses(mut self, on: bool) -> Self {
        self.buffer = on;
        self
    }

    /// The most of one response body held in memory while buffering (default
    /// [`DEFAULT_MAX_BUFFERED`]). A body declared larger is not buffered at all; one that
    /// grows past it is handed on as it streams, the part already read first, so the caller
    /// still gets it whole. Either way a cut past this point is the caller's error, not
    /// retried.
    pub fn max_buffered(mut self, bytes: usize) -> Self {
        self.max_buffered = bytes;
        self
    }

    /// The longest `Retry-After` honoured (default 60 s): a server asking for more makes the
    /// middleware give up and return that response.
    pub fn max_retry_after(mut self, max: Duration) -> Self {
        self.max_retry_after = max;
        self
    }

    /// The middleware.
    pub fn build(self) -> IdempotentRetry {
        IdempotentRetry {
            backoff: ExponentialBackoff::builder()
                .retry_bounds(self.min_wait, self.max_wait)
                .jitter(Jitter::Full)
                .base(2)
                .build_with_max_retries(self.max_attempts - 1),
            max_attempts: self.max_attempts,
            deadline: self.deadline,
            format: self.format,
            buffer: self.buffer,
            max_buffered: self.max_buffered,
            max_retry_after: self.max_retry_after,
        }
    }
}

/// Whether an HTTP method is safe (retried without a key).
fn is_safe(method: &reqwest::Method) -> bool {
    matches!(method.as_str(), "GET" | "HEAD" | "OPTIONS" | "TRACE")
}

/// Whether a status asks to try again later: 408, 409 (still in progress), 425, 429 and 5xx.
pub fn is_retryable_status(status: StatusCode) -> bool {
    matches!(status.as_u16(), 408 | 409 | 425 | 429) || status.is_server_error()
}

/// Whether a transport error may go away on a retry: connection refused or reset, a timeout,
/// or a connection that broke before the whole response arrived. Not: a request that could
/// not be built, a redirect loop, or a middleware's own error.
pub fn is_retryable_error(error: &reqwest_middleware::Error) -> bool {
    match error {
        reqwest_middleware::Error::Reqwest(e) => {
            // (A body cut short reads as a decode error: retried.)
            !e.is_builder() && !e.is_redirect() && !e.is_status()
        }
        reqwest_middleware::Error::Middleware(_) => false,
    }
}

/// What a `Retry-After` value asks for: delta-seconds or an HTTP date (RFC 9110 §10.2.3).
pub fn parse_retry_after(value: &HeaderValue) -> Option<Duration> {
    let text = value.to_str().ok()?.trim();
    if let Ok(secs) = text.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = httpdate::parse_http_date(text).ok()?;
    Some(
        at.duration_since(SystemTime::now())
            .unwrap_or(Duration::ZERO),
    )
}

impl IdempotentRetry {
    fn new_key(&self) -> String {
        let uuid = uuid::Uuid::new_v4();
        match self.format {
            KeyFormat::Bare => uuid.to_string(),
            KeyFormat::SfString => format!("\"{uuid}\""),
        }
    }

    /// One attempt, bounded by `deadline`; with `buffer`, the body is read too, up to
    /// [`IdempotentRetryBuilder::max_buffered`] bytes.
    async fn attempt(
        &self,
        req: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
        deadline: Option<Instant>,
        buffer: bool,
    ) -> reqwest_middleware::Result<Response> {
        let attempt = async {
            let res = next.run(req, extensions).await?;
            if buffer {
                read_whole(res, self.max_buffered).await
            } else {
                Ok(res)
            }
        };
        let Some(deadline) = deadline else {
            return attempt.await;
        };
        match tokio::time::timeout_at(deadline, attempt).await {
            Ok(result) => result,
            Err(_) => Err(reqwest_middleware::Error::middleware(DeadlineExceeded)),
        }
    }
}

/// The deadline of [`IdempotentRetryBuilder::deadline`] passed during an attempt.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("the retry deadline passed while an attempt was in flight")]
pub struct DeadlineExceeded;

/// The response with its body read, so a connection cut inside the body is an error here;
/// at most `limit` bytes of it are held (and one chunk more, the one found past it). A body
/// declared larger is returned as it is; one that grows past `limit` is returned streaming,
/// what was read first (nothing is lost).
///
/// The body is read into one buffer (sized by `Content-Length` when declared, capped at
/// `limit`) that becomes the response's body without a copy: holding the chunks and joining
/// them at the end would hold the body twice.
async fn read_whole(mut res: Response, limit: usize) -> reqwest_middleware::Result<Response> {
    let declared = res.content_length();
    if declared.is_some_and(|n| n > u64::try_from(limit).unwrap_or(u64::MAX)) {
        return Ok(res);
    }
    let url = res.url().clone();
    let (status, version) = (res.status(), res.version());
    let headers = std::mem::take(res.headers_mut());
    let extensions = std::mem::take(res.extensions_mut());
    // `declared` is at most `limit` here.
    let mut read = Vec::with_capacity(declared.map_or(0, |n| usize::try_from(n).unwrap_or(0)));
    let body = loop {
        match res.chunk().await? {
            None => break reqwest::Body::from(read),
            Some(chunk) if chunk.len() > limit - read.len() => {
                // Past the limit: what was read goes on as one piece, then this chunk and the
                // rest as they come.
                use futures_util::StreamExt;
                let first = futures_util::stream::iter([Ok(read.into()), Ok(chunk)]);
                break reqwest::Body::wrap_stream(first.chain(res.bytes_stream()));
            }
            Some(chunk) => {
                if read.capacity() - read.len() < chunk.len() {
                    // Doubling, as `Vec` grows, but never past the limit.
                    let want = (read.capacity() * 2)
                        .max(read.len() + chunk.len())
                        .min(limit);
                    read.reserve_exact(want - read.len());
                }
                read.extend_from_slice(&chunk);
            }
        }
    };
    // The builder's `url` is how reqwest lets a rebuilt response keep its URL.
    let (mut parts, ()) = reqwest::ResponseBuilderExt::url(http::Response::builder(), url)
        .body(())
        .map_err(reqwest_middleware::Error::middleware)?
        .into_parts();
    parts.status = status;
    parts.version = version;
    parts.headers = headers;
    parts.extensions.extend(extensions);
    Ok(Response::from(http::Response::from_parts(parts, body)))
}

#[async_trait::async_trait]
impl Middleware for IdempotentRetry {
    async fn handle(
        &self,
        mut req: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        let start = Instant::now();
        let started_at = SystemTime::now();
        // `None`: no deadline (`Duration::MAX`, or one past what the clock can hold).
        let deadline = start.checked_add(self.deadline);
        // The key is made once, here, before the first attempt: every retry carries it.
        let key = if is_safe(req.method()) {
            None
        } else if let Some(set) = req.headers().get(IDEMPOTENCY_KEY) {
            Some(String::from_utf8_lossy(set.as_bytes()).into_owned())
        } else {
            let key = self.new_key();
            let value = HeaderValue::from_str(&key)
                .map_err(|e| reqwest_middleware::Error::middleware(std::io::Error::other(e)))?;
            req.headers_mut().insert(IDEMPOTENCY_KEY, value);
            Some(key)
        };
        let mut attempts: u32 = 0;
        loop {
            attempts += 1;
            let Some(this) = req.try_clone() else {
                // A body that cannot be cloned (a stream): one attempt.
                // Never retried, so nothing to gain from reading the body here.
                let outcome = self.attempt(req, extensions, next, deadline, false).await;
                return with_key(outcome, key);
            };
            let outcome = self
                .attempt(
                    this,
                    extensions,
                    next.clone(),
                    deadline,
                    self.buffer && key.is_some(),
                )
                .await;
            let retry_after = match &outcome {
                Ok(res) if is_retryable_status(res.status()) && !is_replay(res) => {
                    res.headers().get(RETRY_AFTER).and_then(parse_retry_after)
                }
                Err(e) if is_retryable_error(e) => None,
                _ => return with_key(outcome, key),
            };
            if attempts >= self.max_attempts
                || retry_after.is_some_and(|wait| wait > self.max_retry_after)
            {
                return with_key(outcome, key);
            }
            let backoff = match self.backoff.should_retry(started_at, attempts - 1) {
                RetryDecision::Retry { execute_after } => execute_after
                    .duration_since(SystemTime::now())
                    .unwrap_or(Duration::ZERO),
                RetryDecision::DoNotRetry => return with_key(outcome, key),
            };
            // The server's `Retry-After` is a floor; the jittered backoff may ask for more.
            let wait = retry_after.map_or(backoff, |asked| asked.max(backoff));
            let passes_deadline = deadline.is_some_and(|deadline| {
                Instant::now()
                    .checked_add(wait)
                    .is_none_or(|after| after >= deadline)
            });
            if passes_deadline {
                return with_key(outcome, key);
            }
            tracing::debug!(
                attempt = attempts,
                wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
                "idempotent retry"
            );
            drop(outcome);
            tokio::time::sleep(wait).await;
        }
    }
}

/// Whether the server says this answer is a stored one (`Idempotent-Replayed: true`): a
/// retry would get it again, unchanged.
fn is_replay(res: &Response) -> bool {
    res.headers()
        .get(IDEMPOTENT_REPLAYED)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"))
}

fn with_key(
    outcome: reqwest_middleware::Result<Response>,
    key: Option<String>,
) -> reqwest_middleware::Result<Response> {
    outcome.map(|mut res| {
        if let Some(key) = key {
            res.extensions_mut().insert(UsedKey(key));
        }
        res
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn statuses() {
        for s in [408, 409, 425, 429, 500, 502, 503, 504] {
            assert!(is_retryable_status(StatusCode::from_u16(s).unwrap()), "{s}");
        }
        for s in [200, 201, 301, 400, 401, 403, 404, 410, 413, 422] {
            assert!(
                !is_retryable_status(StatusCode::from_u16(s).unwrap()),
                "{s}"
            );
        }
    }

    #[test]
    fn retry_after_forms() {
        assert_eq!(
            parse_retry_after(&HeaderValue::from_static("3")),
            Some(Duration::from_secs(3))
        );
        let later = SystemTime::now() + Duration::from_secs(120);
        let date = HeaderValue::from_str(&httpdate::fmt_http_date(later)).unwrap();
        let wait = parse_retry_after(&date).unwrap();
        assert!(wait > Duration::from_secs(100) && wait <= Duration::from_secs(120));
        let past = HeaderValue::from_static("Wed, 21 Oct 2015 07:28:00 GMT");
        assert_eq!(parse_retry_after(&past), Some(Duration::ZERO));
        assert_eq!(parse_retry_after(&HeaderValue::from_static("soon")), None);
        assert_eq!(parse_retry_after(&HeaderValue::from_static("-1")), None);
    }
}
