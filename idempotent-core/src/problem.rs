//! RFC 9457 problem details for the failures the adapters answer with.
//!
//! Problem bodies describe what the client can do about a failure and never carry internals
//! (database errors, table names, SQL): those go to the log (`tracing`) where they happen.

use crate::duration::format_duration;
use crate::key::KeyError;
use crate::scope::ScopeError;
use crate::store::record::retry_after_secs;
use problem_details::ProblemDetails;
use std::time::Duration;

/// The base of our problem type URIs.
pub const PROBLEM_BASE: &str = "https://idempotent.dev/problems/";

/// A failure to answer with `application/problem+json` (plus `Retry-After` when set).
#[derive(Debug, Clone)]
pub struct Problem {
    /// The RFC 9457 body (type, title, status, detail).
    pub details: ProblemDetails,
    /// HTTP status.
    pub status: u16,
    /// Seconds for `Retry-After`, if the client should retry.
    pub retry_after: Option<u64>,
    /// The last segment of the type URI (`idempotency-key-missing`).
    pub slug: &'static str,
}

impl Problem {
    fn new(slug: &'static str, status: u16, title: &str, detail: String) -> Self {
        let code =
            http::StatusCode::from_u16(status).unwrap_or(http::StatusCode::INTERNAL_SERVER_ERROR);
        let uri: http::Uri = format!("{PROBLEM_BASE}{slug}")
            .parse()
            .unwrap_or_else(|_| http::Uri::from_static("about:blank"));
        Problem {
            details: ProblemDetails::new()
                .with_type(uri)
                .with_status(code)
                .with_title(title)
                .with_detail(detail),
            status,
            retry_after: None,
            slug,
        }
    }

    /// 400: the key is missing or malformed.
    pub fn key(error: &KeyError) -> Self {
        match error {
            KeyError::Missing => Self::new(
                "idempotency-key-missing",
                400,
                "Idempotency-Key header missing",
                "this endpoint requires an `Idempotency-Key` header; send a unique value (such as a UUID) per operation and reuse it on retries".into(),
            ),
            other => Self::new(
                "idempotency-key-invalid",
                400,
                "Idempotency-Key header invalid",
                format!("{other}; a key is 1-255 visible ASCII characters, bare or as a quoted string"),
            ),
        }
    }

    /// 400: the caller's scope value cannot identify a caller.
    pub fn scope(error: &ScopeError) -> Self {
        Self::new(
            "idempotency-scope-invalid",
            400,
            "Caller identity unusable for idempotency",
            format!("{error}"),
        )
    }

    /// 409: the first attempt is still running.
    pub fn in_progress(retry_after: Duration) -> Self {
        let secs = retry_after_secs(retry_after);
        let mut p = Self::new(
            "idempotency-key-in-progress",
            409,
            "A request with this Idempotency-Key is in progress",
            format!(
                "the first request with this key has not finished; retry in {secs} s to get its response"
            ),
        );
        p.retry_after = Some(secs);
        p
    }

    /// 422: the key was used for a different request.
    pub fn mismatch(in_progress: bool) -> Self {
        Self::new(
            "idempotency-key-mismatch",
            422,
            "Idempotency-Key reused for a different request",
            format!(
                "this key was already used with a different method, path or body (that request is {}); use a new key for a new operation",
                if in_progress {
                    "still in progress"
                } else {
                    "finished"
                }
            ),
        )
    }

    /// 503: the store failed; the handler did not run. The store's error is logged where it
    /// happened, never put in the body.
    pub fn store_unavailable() -> Self {
        let mut p = Self::new(
            "idempotency-store-unavailable",
            503,
            "Idempotency store unavailable",
            "the request was not processed because its idempotency record could not be claimed; retry later with the same key".into(),
        );
        p.retry_after = Some(1);
        p
    }

    /// 503: the server is shutting down and starts no new work; the handler did not run.
    pub fn shutting_down() -> Self {
        let mut p = Self::new(
            "idempotency-shutting-down",
            503,
            "Server shutting down",
            "the server is shutting down and did not process the request; retry with the same key"
                .into(),
        );
        p.retry_after = Some(1);
        p
    }

    /// 400: the request body could not be read (malformed framing, a client that went away).
    pub fn request_body_invalid() -> Self {
        Self::new(
            "idempotency-request-body-invalid",
            400,
            "Request body unreadable",
            "the request body could not be read completely; nothing was processed, retry with the same key".into(),
        )
    }

    /// 410: the original response was not stored (too large, or a stream that had not ended
    /// when its client left), so it cannot be replayed; the handler will not run again.
    pub fn response_not_stored(status: u16, size: u64) -> Self {
        Self::new(
            "idempotency-response-not-stored",
            410,
            "Original response not replayable",
            format!(
                "the request with this key was processed (status {status}) but its response ({size} bytes) was not stored: it exceeded the route's limit, or its stream stalled or outlived its client; it will not run again"
            ),
        )
    }

    /// 413: the request body is larger than the idempotency layer buffers.
    pub fn request_too_large(limit: usize) -> Self {
        Self::new(
            "idempotency-request-too-large",
            413,
            "Request body too large",
            format!("the request body exceeds {limit} bytes, the most this endpoint fingerprints"),
        )
    }

    /// 408: the request body did not arrive within the configured time
    /// ([`ConfigBuilder::request_body_timeout`](crate::http::ConfigBuilder::request_body_timeout)).
    /// Nothing was claimed: a retry with the same key runs normally.
    pub fn request_timeout(timeout: std::time::Duration) -> Self {
        Self::new(
            "idempotency-request-timeout",
            408,
            "Request body too slow",
            format!(
                "the request body did not arrive within {}; send it again with the same key",
                format_duration(timeout)
            ),
        )
    }

    /// 500: the server is misconfigured (the adapter's layer is missing, a route's arguments
    /// do not fit the configuration). The client is told nothing about the server's wiring:
    /// log what to fix where it is found.
    pub fn misconfigured() -> Self {
        Self::new(
            "idempotency-misconfigured",
            500,
            "Idempotency misconfigured on the server",
            "the server's idempotency setup is incomplete or inconsistent, so nothing was processed; the details are in the server's log".into(),
        )
    }

    /// 500: the handler's response failed before it could be sent (its body returned an
    /// error); nothing was stored and the key was released.
    pub fn response_failed() -> Self {
        Self::new(
            "idempotency-response-failed",
            500,
            "Response failed",
            "the response failed before it could be sent; nothing was stored, retry with the same key".into(),
        )
    }

    /// 503: the handler was still running when its lease ended, on a database where its open
    /// transaction holds up every other writer (SQLite): it was stopped, its writes rolled
    /// back and the key released, so a retry runs it again.
    pub fn handler_timed_out() -> Self {
        let mut p = Self::new(
            "idempotency-handler-timed-out",
            503,
            "Handler stopped",
            "the request was not completed within its lease, so everything it wrote was rolled back and nothing was stored; retry with the same key".into(),
        );
        p.retry_after = Some(1);
        p
    }

    /// The JSON body.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(&self.details).unwrap_or_else(|_| b"{}".to_vec())
    }

    /// The problem type's URI.
    pub fn type_uri(&self) -> String {
        format!("{PROBLEM_BASE}{}", self.slug)
    }
}
