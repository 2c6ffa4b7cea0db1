//! What the library answers itself: replays, problems, and the map from the engine's steps.

use super::{IDEMPOTENT_REPLAYED, PROBLEM_JSON};
use crate::engine::{Begin, Execution, Unprotected};
use crate::problem::Problem;
use crate::store::record::{StoredOutcome, StoredResponse};
use std::borrow::Cow;

/// A response the library produces itself (a replay or a problem), on plain types.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    /// HTTP status.
    pub status: u16,
    /// Header lines in order (names lower case); repeated names appear repeatedly.
    pub headers: Vec<(Cow<'static, str>, Cow<'static, [u8]>)>,
    /// The body.
    pub body: Vec<u8>,
}

impl Reply {
    /// A stored response as its replay: status, every stored header in order, the body, and
    /// `Idempotent-Replayed: true`.
    pub fn replay(stored: StoredResponse) -> Self {
        // Collected in place: the lines are the same size as the stored ones, so the stored
        // vector's allocation is reused (and grown only if it has no room for the marker).
        let mut headers: Vec<(Cow<'static, str>, Cow<'static, [u8]>)> = stored
            .headers
            .into_iter()
            .filter(|(name, _)| !name.eq_ignore_ascii_case(IDEMPOTENT_REPLAYED))
            .map(|(n, v)| (Cow::Owned(n), Cow::Owned(v)))
            .collect();
        headers.push((Cow::Borrowed(IDEMPOTENT_REPLAYED), Cow::Borrowed(b"true")));
        Reply {
            status: stored.status,
            headers,
            body: stored.body,
        }
    }

    /// A header value of a reply as [`Bytes`](bytes::Bytes), without a copy: a stored value is
    /// moved, a static one borrowed. For an adapter whose header values can take shared bytes.
    ///
    /// ```
    /// use idempotent_core::__private::Reply;
    /// use std::borrow::Cow;
    /// assert_eq!(Reply::shared(Cow::Borrowed(b"true")), "true");
    /// assert_eq!(Reply::shared(Cow::Owned(b"v".to_vec())), "v");
    /// ```
    pub fn shared(value: Cow<'static, [u8]>) -> bytes::Bytes {
        match value {
            Cow::Borrowed(value) => bytes::Bytes::from_static(value),
            Cow::Owned(value) => bytes::Bytes::from(value),
        }
    }

    /// The answer to an engine's `begin` that runs nothing (a replay, a problem); a 500 for
    /// one that would run the handler, which callers never pass.
    pub(crate) fn answer(begin: Begin) -> Self {
        match Step::from(begin) {
            Step::Respond(reply) => reply,
            Step::Execute(_) | Step::Unprotected => Reply::problem(&Problem::misconfigured()),
        }
    }

    /// A problem as `application/problem+json` with `Cache-Control: no-store` and, when set,
    /// `Retry-After`.
    pub fn problem(p: &Problem) -> Self {
        let mut headers: Vec<(Cow<'static, str>, Cow<'static, [u8]>)> = vec![
            (
                Cow::Borrowed("content-type"),
                Cow::Borrowed(PROBLEM_JSON.as_bytes()),
            ),
            (Cow::Borrowed("cache-control"), Cow::Borrowed(b"no-store")),
        ];
        if let Some(secs) = p.retry_after {
            headers.push((
                Cow::Borrowed("retry-after"),
                Cow::Owned(secs.to_string().into_bytes()),
            ));
        }
        Reply {
            status: p.status,
            headers,
            body: p.to_json(),
        }
    }
}

/// The header a first execution's response carries: `Idempotent-Replayed: false`.
pub const FIRST_EXECUTION: (&str, &str) = (IDEMPOTENT_REPLAYED, "false");

/// What to do with a request after [`Engine::begin`]. Deliberately exhaustive: an adapter
/// matches all three, with no wildcard arm for a variant it does not know.
#[derive(Debug)]
pub(crate) enum Step {
    /// Run the handler under this execution, capture its response, finish the execution.
    Execute(Execution),
    /// Run the handler without a record (no key on an optional route, or fail-open).
    Unprotected,
    /// Answer with this; the handler does not run.
    Respond(Reply),
}

impl From<Begin> for Step {
    /// The one map from the engine's answer to the wire: exhaustive, so a new variant is a
    /// compile error here rather than a run-time 500.
    fn from(begin: Begin) -> Self {
        match begin {
            Begin::Claimed(execution) => Step::Execute(execution),
            Begin::Replay(StoredOutcome::Response(stored)) => Step::Respond(Reply::replay(stored)),
            Begin::Replay(StoredOutcome::Oversized { status, size }) => {
                Step::Respond(Reply::problem(&Problem::response_not_stored(status, size)))
            }
            Begin::InProgress { retry_after } => {
                Step::Respond(Reply::problem(&Problem::in_progress(retry_after)))
            }
            Begin::Mismatch { in_progress } => {
                Step::Respond(Reply::problem(&Problem::mismatch(in_progress)))
            }
            Begin::KeyRejected(e) => Step::Respond(Reply::problem(&Problem::key(&e))),
            Begin::Unprotected(Unprotected::NoKey | Unprotected::FailedOpen(_)) => {
                Step::Unprotected
            }
            Begin::StoreUnavailable(_) => {
                Step::Respond(Reply::problem(&Problem::store_unavailable()))
            }
            Begin::Draining => Step::Respond(Reply::problem(&Problem::shutting_down())),
            Begin::Misconfigured(_) => Step::Respond(Reply::problem(&Problem::misconfigured())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn replay_never_echoes_a_stored_replayed_header() {
        let stored = StoredResponse::new(201, "b")
            .with_header("Idempotent-Replayed", "false")
            .with_header("x", "1")
            .with_header("x", "2");
        let reply = Reply::replay(stored);
        let headers: Vec<(&str, &[u8])> = reply
            .headers
            .iter()
            .map(|(n, v)| (n.as_ref(), v.as_ref()))
            .collect();
        assert_eq!(
            headers,
            vec![
                ("x", &b"1"[..]),
                ("x", b"2"),
                ("idempotent-replayed", b"true")
            ]
        );
        assert_eq!((reply.status, reply.body.as_slice()), (201, &b"b"[..]));
    }

    #[test]
    fn problems_carry_their_headers() {
        let r = Reply::problem(&Problem::in_progress(Duration::from_millis(2500)));
        assert_eq!(r.status, 409);
        let find = |n: &str| {
            r.headers
                .iter()
                .find(|(k, _)| k == n)
                .map(|(_, v)| v.to_vec())
        };
        assert_eq!(find("content-type"), Some(PROBLEM_JSON.as_bytes().to_vec()));
        assert_eq!(find("cache-control"), Some(b"no-store".to_vec()));
        assert_eq!(find("retry-after"), Some(b"3".to_vec()));
        let body: serde_json::Value = serde_json::from_slice(&r.body).expect("json");
        assert_eq!(body["status"], 409);
        assert_eq!(
            body["type"],
            "https://docs.rs/idempotent-core/0.1/idempotent_core/struct.Problem.html#idempotency-key-in-progress"
        );
    }
}
