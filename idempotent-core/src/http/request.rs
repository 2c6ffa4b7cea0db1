//! What the driver checks and computes on a request before the engine sees it: which methods
//! are protected, the key and `Content-Length` checks that need no body, which response
//! headers are stored, and the request's fingerprint.

use super::IDEMPOTENT_REPLAYED;
use crate::engine::KeyRequirement;
use crate::fingerprint::{Fingerprint, FingerprintInput};
use crate::key::{IdempotencyKey, KeyError};
use crate::problem::Problem;

/// Whether a method is safe (GET, HEAD, OPTIONS): its requests ignore the key and run.
///
/// ```
/// use idempotent_core::__private::is_safe_method;
/// assert!(is_safe_method("GET") && !is_safe_method("POST") && !is_safe_method("PATCH"));
/// ```
pub fn is_safe_method(method: &str) -> bool {
    matches!(method, "GET" | "HEAD" | "OPTIONS")
}

/// Whether a response header is stored for replays, by its name alone. Hop-by-hop headers,
/// `Date`, `Content-Length` (replays are framed anew), `Set-Cookie` (a replay must not hand
/// one caller's session to a retry) and our own `Idempotent-Replayed` are not. `name` is
/// compared case-insensitively. A response may make any other header hop-by-hop by naming it
/// in its `Connection` header (RFC 9110 §7.6.1): [`connection_options`] reads those names, and
/// the copy a replay is made from ([`Capture`](crate::__private::Capture)) drops them too.
pub(crate) fn is_stored_header(name: &str) -> bool {
    const NEVER: [&str; 13] = [
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "date",
        "content-length",
        "set-cookie",
        IDEMPOTENT_REPLAYED,
    ];
    !NEVER.iter().any(|n| n.eq_ignore_ascii_case(name))
}

/// The header names a `Connection` header value lists (RFC 9110 §7.6.1: `Connection: X-Hop,
/// keep-alive` makes `X-Hop` and `Keep-Alive` hop-by-hop for this response): its
/// comma-separated elements, without the spaces and tabs around them, empty ones skipped.
pub(crate) fn connection_options(value: &[u8]) -> impl Iterator<Item = &[u8]> {
    value
        .split(|&b| b == b',')
        .map(|element| element.trim_ascii())
        .filter(|name| !name.is_empty())
}

/// The checks on the key that need neither the body nor the store, run first: a malformed key
/// is refused on every route, a missing one where the route requires it.
///
/// # Errors
/// The 400 problem to answer with.
pub(crate) fn check_key(
    key: &Result<IdempotencyKey, KeyError>,
    requirement: KeyRequirement,
) -> Result<(), Box<Problem>> {
    match key {
        Ok(_) => Ok(()),
        Err(KeyError::Missing) if requirement == KeyRequirement::Optional => Ok(()),
        Err(e) => Err(Box::new(Problem::key(e))),
    }
}

/// Refuses a request whose declared `Content-Length` is over the limit before its body is
/// read (an absent or unparsable header is left to the read itself).
///
/// # Errors
/// The 413 problem.
pub(crate) fn check_content_length(value: Option<&[u8]>, limit: usize) -> Result<(), Box<Problem>> {
    let declared = value
        .and_then(|v| std::str::from_utf8(v).ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    match declared {
        Some(n) if n > limit as u64 => Err(Box::new(Problem::request_too_large(limit))),
        _ => Ok(()),
    }
}

/// The parts of a request that identify it, borrowed from the framework's request.
#[derive(Debug, Clone, Copy)]
pub struct RequestHead<'a> {
    /// The method (`POST`).
    pub method: &'a str,
    /// The path as received, with any prefix a nested router stripped put back: never the
    /// route template, and not normalised.
    pub path: &'a str,
    /// The query string as sent, without `?`.
    pub query: Option<&'a str>,
    /// The `Content-Type` header, if it is valid text.
    pub content_type: Option<&'a str>,
}

/// The largest body [`RequestHead::fingerprint_async`] fingerprints on the async worker
/// itself: 8 KiB.
///
/// Measured (release build, 2-core machine): a fingerprint costs about 0.5 µs per KiB raw,
/// 3 µs per KiB of JSON and 6–9 µs per KiB of a typical form (up to about 50 µs per KiB for
/// a hostile form of one-byte fields out of order), while handing a closure to tokio's
/// blocking pool and back costs about 7 µs. At 8 KiB a fingerprint takes some 25–70 µs: the
/// hand-off would be a large share of that, and the worker is held up no longer than
/// tokio's guidance between awaits (10–100 µs). Above it the computation grows with the
/// body, the hand-off does not: a 2 MiB body costs 1–100 ms.
pub const FINGERPRINT_INLINE_MAX: usize = 8 << 10;

impl RequestHead<'_> {
    /// The request's fingerprint over this head and `body`, computed here and now (for a large
    /// body on an async worker, prefer [`RequestHead::fingerprint_async`]).
    pub fn fingerprint(&self, body: &[u8]) -> Fingerprint {
        Fingerprint::compute(&FingerprintInput {
            method: self.method,
            path: self.path,
            query: self.query,
            content_type: self.content_type,
            body,
        })
    }

    /// [`RequestHead::fingerprint`], off the async workers for a body above
    /// [`FINGERPRINT_INLINE_MAX`]: on tokio's blocking pool (`spawn_blocking`), so a 2 MiB
    /// form or JSON body does not hold up the other requests of its worker thread (on
    /// actix-web's single-threaded runtimes too, which have a blocking pool). Smaller bodies,
    /// and any body outside a tokio runtime, are fingerprinted inline. The body is owned
    /// (`Bytes`, `Vec<u8>`) because the computation may outlive this future's borrow.
    ///
    /// Never fails: if the blocking task cannot give an answer (the runtime is shutting down
    /// and refused it, or it panicked), the fingerprint is computed inline instead, so the
    /// request is still answered.
    ///
    /// ```
    /// use idempotent_core::__private::RequestHead;
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let head = RequestHead {
    ///     method: "POST", path: "/v1/charges", query: None,
    ///     content_type: Some("application/json"),
    /// };
    /// let body = vec![b' '; 1 << 20]; // 1 MiB of whitespace: hashed raw, off the worker
    /// assert_eq!(head.fingerprint_async(body.clone()).await, head.fingerprint(&body));
    /// # }
    /// ```
    pub async fn fingerprint_async<B>(&self, body: B) -> Fingerprint
    where
        B: AsRef<[u8]> + Send + Sync + 'static,
    {
        if body.as_ref().len() <= FINGERPRINT_INLINE_MAX {
            return self.fingerprint(body.as_ref());
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return self.fingerprint(body.as_ref());
        };
        // Shared, so the body is still here for the inline fallback.
        let body = std::sync::Arc::new(body);
        let task = {
            let body = std::sync::Arc::clone(&body);
            let (method, path) = (self.method.to_owned(), self.path.to_owned());
            let query = self.query.map(str::to_owned);
            let content_type = self.content_type.map(str::to_owned);
            runtime.spawn_blocking(move || {
                RequestHead {
                    method: &method,
                    path: &path,
                    query: query.as_deref(),
                    content_type: content_type.as_deref(),
                }
                .fingerprint((*body).as_ref())
            })
        };
        match task.await {
            Ok(fingerprint) => fingerprint,
            Err(error) => {
                tracing::warn!(%error, "idempotency: fingerprinting on the blocking pool failed; computed inline");
                self.fingerprint((*body).as_ref())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_headers_connection_options_and_key_checks() {
        assert!(is_stored_header("content-type") && is_stored_header("Location"));
        assert!(!is_stored_header("Set-Cookie") && !is_stored_header("transfer-encoding"));
        let names: Vec<&[u8]> = connection_options(b"X-Hop, ,\tkeep-alive ").collect();
        assert_eq!(names, [&b"X-Hop"[..], b"keep-alive"]);
        let missing = IdempotencyKey::from_header_values::<&[u8]>([]);
        assert_eq!(
            check_key(&missing, KeyRequirement::Required)
                .unwrap_err()
                .status,
            400
        );
        assert!(check_key(&missing, KeyRequirement::Optional).is_ok());
    }
    use crate::http::capture::Capture;
    use crate::store::record::StoredOutcome;

    #[test]
    fn header_filter() {
        for never in [
            "Connection",
            "keep-alive",
            "Proxy-Authenticate",
            "proxy-authorization",
            "proxy-connection",
            "TE",
            "trailer",
            "Transfer-Encoding",
            "upgrade",
            "Date",
            "content-length",
            "Set-Cookie",
            "Idempotent-Replayed",
        ] {
            assert!(!is_stored_header(never), "{never} must not be stored");
        }
        for kept in [
            "content-type",
            "location",
            "etag",
            "cache-control",
            "x-request-id",
            "link",
            "content-encoding",
        ] {
            assert!(is_stored_header(kept), "{kept} must be stored");
        }
        // Capture applies the filter and keeps repeats in order.
        let c = Capture::new(
            201,
            [
                ("x-a", &b"1"[..]),
                ("set-cookie", b"s=1"),
                ("x-a", b"2"),
                ("date", b"now"),
                ("idempotent-replayed", b"false"),
                ("Content-Length", b"2"),
            ],
            10,
        );
        let StoredOutcome::Response(r) = c.finish() else {
            panic!("oversized")
        };
        assert_eq!(
            r.headers,
            vec![
                ("x-a".to_owned(), b"1".to_vec()),
                ("x-a".to_owned(), b"2".to_vec())
            ]
        );
    }

    #[test]
    fn cheap_checks() {
        assert!(check_content_length(Some(b"10"), 10).is_ok());
        assert_eq!(
            check_content_length(Some(b"11"), 10).map_err(|p| p.status),
            Err(413)
        );
        assert!(check_content_length(Some(b"junk"), 10).is_ok());
        assert!(check_content_length(None, 10).is_ok());
        let bad = IdempotencyKey::parse(b"");
        assert_eq!(
            check_key(&bad, KeyRequirement::Optional).map_err(|p| p.slug),
            Err("idempotency-key-invalid"),
            "a malformed key is never optional"
        );
        let missing = Err(KeyError::Missing);
        assert_eq!(
            check_key(&missing, KeyRequirement::Required).map_err(|p| p.slug),
            Err("idempotency-key-missing")
        );
    }
}
