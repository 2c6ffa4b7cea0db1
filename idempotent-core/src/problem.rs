//! RFC 9457 problem details for the failures the adapters answer with.
//!
//! Problem bodies describe what the client can do about a failure and never carry internals
//! (database errors, table names, SQL): those go to the log (`tracing`) where they happen.

use crate::duration::format_duration;
use crate::key::KeyError;
use crate::scope::ScopeError;
use crate::store::record::retry_after_secs;
use std::time::Duration;

/// The base of our problem type URIs: each type is this base followed by its slug, the
/// anchor of its heading in the documentation of [`Problem`] (the list there).
///
/// They point at this crate's own published documentation because it is a home the project
/// has: docs.rs serves every published version, so each URI resolves, once the crate is
/// published, to the description of its problem. The version in the path is the semver
/// requirement `0.1`, which docs.rs resolves to the newest 0.1.x release, so a problem's URI
/// stays the same across the whole 0.1 line (a client may compare it as a string).
pub const PROBLEM_BASE: &str =
    "https://docs.rs/idempotent-core/0.1/idempotent_core/struct.Problem.html#";

/// A failure to answer with `application/problem+json` (RFC 9457): its `type` (a URI made of
/// [`PROBLEM_BASE`] and the slug), `title`, `status` and `detail`, plus `Retry-After` when
/// set, and `Cache-Control: no-store` from the adapter.
///
/// # Problem types
///
/// The `type` of every problem the library answers with is
/// `https://docs.rs/idempotent-core/0.1/idempotent_core/struct.Problem.html#<slug>`, the
/// heading of the slug below. A client branches on the `type` (or the status); the `title`
/// names the type and the `detail` says what happened this time. No problem carries
/// internals (database errors, table names, SQL).
///
/// ## `idempotency-key-missing`
/// **400.** The route requires an `Idempotency-Key` header and the request has none. Send a
/// unique key (such as a UUID) per operation, and the same key on each of its retries.
///
/// ## `idempotency-key-invalid`
/// **400.** The `Idempotency-Key` header is malformed: empty, longer than 255 characters,
/// with a character that is not visible ASCII, a quoted string (RFC 8941) that is not
/// well formed, or several `Idempotency-Key` lines. Nothing was read or claimed.
///
/// ## `idempotency-scope-invalid`
/// **400.** The caller's identity the route keys its records by cannot be used (empty,
/// longer than 1,024 bytes, holding NUL, or starting with `call:`, which is reserved).
/// Nothing was claimed.
///
/// ## `idempotency-key-in-progress`
/// **409**, with `Retry-After`. The first request with this key has not finished. Retry with
/// the same key after `Retry-After` seconds to get its response; the operation is not run
/// twice.
///
/// ## `idempotency-key-mismatch`
/// **422.** The key was already used for a different request: another method, path, query,
/// media type or body, or another route. Use a new key for a new operation.
///
/// ## `idempotency-store-unavailable`
/// **503**, with `Retry-After`. The idempotency store could not be reached or failed, so the
/// request was not processed. Retry later with the same key.
///
/// ## `idempotency-shutting-down`
/// **503**, with `Retry-After`. The server is shutting down and starts no new work; the
/// request was not processed. Retry with the same key.
///
/// ## `idempotency-request-body-invalid`
/// **400.** The request body could not be read completely (malformed framing, a client that
/// went away); nothing was processed. Retry with the same key.
///
/// ## `idempotency-response-not-stored`
/// **410.** The request with this key was processed, but its response was not stored: it was
/// larger than the route's limit, or its stream stalled or outlived its client. It cannot be
/// replayed, and the operation will not run again under this key.
///
/// ## `idempotency-request-too-large`
/// **413.** The request body is larger than the route fingerprints (its `max_request`);
/// nothing was processed.
///
/// ## `idempotency-request-timeout`
/// **408.** The request body did not arrive within the server's time limit; nothing was
/// claimed. Send it again with the same key.
///
/// ## `idempotency-misconfigured`
/// **500.** The server's idempotency setup is incomplete or inconsistent (the details are in
/// its log), so nothing was processed.
///
/// ## `idempotency-response-failed`
/// **500.** The handler's response failed before it could be sent; nothing was stored and
/// the key was released. Retry with the same key.
///
/// ## `idempotency-handler-timed-out`
/// **503**, with `Retry-After`. The handler was still running when its lease ended, on a
/// database where its open transaction holds up every other writer (SQLite): it was stopped,
/// its writes were rolled back and the key released. Retry with the same key.
#[derive(Debug, Clone)]
pub struct Problem {
    /// HTTP status.
    pub status: u16,
    /// The type's short summary (RFC 9457 `title`), the same for every problem of the type.
    pub title: &'static str,
    /// What happened this time and what the client can do (RFC 9457 `detail`).
    pub detail: String,
    /// Seconds for `Retry-After`, if the client should retry.
    pub retry_after: Option<u64>,
    /// The last segment of the type URI, its anchor (`idempotency-key-missing`).
    pub slug: &'static str,
}

/// The RFC 9457 body, in the order of its members in the RFC.
#[derive(serde::Serialize)]
struct Body<'a> {
    r#type: &'a str,
    status: u16,
    title: &'a str,
    detail: &'a str,
}

impl Problem {
    fn new(slug: &'static str, status: u16, title: &'static str, detail: String) -> Self {
        Problem {
            status,
            title,
            detail,
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

    /// The JSON body: `type`, `status`, `title` and `detail`.
    pub fn to_json(&self) -> Vec<u8> {
        let body = Body {
            r#type: &self.type_uri(),
            status: self.status,
            title: self.title,
            detail: &self.detail,
        };
        serde_json::to_vec(&body).unwrap_or_else(|_| b"{}".to_vec())
    }

    /// The problem type's URI.
    pub fn type_uri(&self) -> String {
        format!("{PROBLEM_BASE}{}", self.slug)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every problem this module makes, one per type.
    fn every_problem() -> Vec<Problem> {
        vec![
            Problem::key(&KeyError::Missing),
            Problem::key(&KeyError::Empty),
            Problem::scope(&ScopeError::Empty),
            Problem::in_progress(Duration::from_secs(1)),
            Problem::mismatch(false),
            Problem::store_unavailable(),
            Problem::shutting_down(),
            Problem::request_body_invalid(),
            Problem::response_not_stored(200, 1),
            Problem::request_too_large(1),
            Problem::request_timeout(Duration::from_secs(1)),
            Problem::misconfigured(),
            Problem::response_failed(),
            Problem::handler_timed_out(),
        ]
    }

    /// The slugs this file makes problems of (each `Self::new(` names its slug on the next
    /// line), so a new problem type cannot be left out of the list above or the docs.
    fn slugs_in_source() -> std::collections::BTreeSet<String> {
        let source = include_str!("problem.rs");
        let mut lines = source.lines();
        let mut slugs = std::collections::BTreeSet::new();
        while let Some(line) = lines.next() {
            if line.trim_end().ends_with("Self::new(")
                && let Some(next) = lines.next()
                && let Some(slug) = next.trim().strip_prefix('"')
                && let Some(slug) = slug.strip_suffix("\",")
            {
                slugs.insert(slug.to_owned());
            }
        }
        slugs
    }

    /// A problem's type URI is a page of this crate's published documentation (docs.rs, the
    /// `0.1` line) whose anchor is its slug, and the body carries that URI whole, fragment
    /// included; the docs of [`Problem`] hold one heading per type, which is the anchor.
    #[test]
    fn every_problem_type_is_documented_at_its_uri() {
        let made: std::collections::BTreeSet<String> =
            every_problem().iter().map(|p| p.slug.to_owned()).collect();
        assert_eq!(made, slugs_in_source(), "every_problem() misses a type");
        let source = include_str!("problem.rs");
        for p in every_problem() {
            let uri = p.type_uri();
            assert_eq!(
                uri,
                format!(
                    "https://docs.rs/idempotent-core/0.1/idempotent_core/struct.Problem.html#{}",
                    p.slug
                )
            );
            let body: serde_json::Value = serde_json::from_slice(&p.to_json()).unwrap_or_default();
            assert_eq!(body["type"], uri.as_str(), "{body}");
            assert_eq!(body["status"], p.status, "{body}");
            // A heading whose text is the slug: rustdoc makes its id, the URI's anchor.
            let heading = format!("\n/// ## `{}`\n", p.slug);
            assert!(source.contains(&heading), "no heading `{}`", heading.trim());
        }
        let headings = source
            .lines()
            .filter(|l| l.starts_with("/// ## `idempotency-"))
            .count();
        assert_eq!(headings, made.len(), "a heading for a type no problem has");
    }
}
