//! The handler's response: how it is recorded, and a bounded copy of it.

use super::{connection_options, is_stored_header};
use crate::engine::{Execution, Policy, Progress, Recorded};
use crate::store::record::{StoredOutcome, StoredResponse};
use std::future::Future;
use std::pin::Pin;

/// How a claimed execution's response is recorded, decided from its status and declared size
/// (the same rules for every adapter).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ResponsePlan {
    /// The route does not store this status (5xx, 408/409/425/429): release the key, then send
    /// the response untouched.
    Release,
    /// The body's size is known and within the limit (a JSON response already in memory):
    /// read it whole, store it, then send it, so a client that got the response can retry and
    /// get the replay.
    Collect,
    /// The body is known to be over the limit: store the oversized marker, then stream it.
    Oversized {
        /// The declared size.
        size: u64,
    },
    /// The size is unknown (a stream): send it as it is produced through a [`Recorder`].
    Stream,
}

impl ResponsePlan {
    /// The plan for a response with `status` and, if known, an exact body size.
    pub(crate) fn new(policy: &Policy, status: u16, exact_size: Option<u64>, limit: usize) -> Self {
        if !policy.stores(status) {
            return ResponsePlan::Release;
        }
        match exact_size {
            Some(size) if size <= limit as u64 => ResponsePlan::Collect,
            Some(size) => ResponsePlan::Oversized { size },
            None => ResponsePlan::Stream,
        }
    }
}

/// Records a response body as it goes to the client: owns the claimed [`Execution`] and a
/// bounded [`Capture`], and finishes the execution the way the body ends. An adapter feeds it
/// from its framework's body type; the rules are here:
///
/// - it ends within the limit ([`Recorder::end`]): the copy is stored;
/// - it passes the limit ([`Recorder::data`] returns `false`, then [`Recorder::over_limit`]):
///   the oversized marker is stored, the rest goes through uncopied, and a later error leaves
///   the marker (the handler ran);
/// - it fails before either ([`Recorder::fail`]): nothing is stored, the key is released;
/// - the client goes away first ([`Recorder::abandon`]): the rest is read on the server, for
///   at most one lease, so the outcome is stored and a retry gets the replay, never a second
///   run; a stream that has not ended by then is stored as the oversized marker and dropped;
/// - it produces nothing for a whole lease ([`Recorder::poll_expired`]): the oversized marker
///   is stored (retries get 410) and the rest goes through uncopied. A slow stream that keeps
///   producing is recorded to its end; an idle or endless one (server-sent events waiting for
///   an event) never holds its key in progress for longer than a lease of silence, whether or
///   not the framework notices a client that left meanwhile;
/// - its client stops reading while staying connected: the server stops polling the body
///   once its socket buffers are full, so nothing above runs; the execution's heartbeat
///   watches the body's progress instead and, after a lease in which nothing was sent, stops
///   renewing and stores the oversized marker itself ([`Recorder::is_settled`]; then the
///   rest goes through uncopied).
#[derive(Debug)]
pub struct Recorder {
    capture: Capture,
    execution: Execution,
    /// When recording gives up if nothing more arrives (streamed bodies only).
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    /// The body's progress, which the heartbeat watches (streamed bodies only).
    progress: Option<std::sync::Arc<Progress>>,
}

impl Recorder {
    /// A recorder for a body read whole before it is sent ([`ResponsePlan::Collect`]).
    pub fn new(execution: Execution, capture: Capture) -> Self {
        Recorder {
            capture,
            execution,
            deadline: None,
            progress: None,
        }
    }

    /// A recorder for a body streamed to the client ([`ResponsePlan::Stream`]): the lease is
    /// kept alive by its own task from now on, since a client that stops reading for a while
    /// stops the body being polled.
    pub fn streaming(mut execution: Execution, capture: Capture) -> Self {
        let progress = Progress::new(capture.status());
        execution.watch(std::sync::Arc::clone(&progress));
        let deadline = Box::pin(tokio::time::sleep(execution.policy().lease));
        Recorder {
            capture,
            execution,
            deadline: Some(deadline),
            progress: Some(progress),
        }
    }

    /// Whether the execution's heartbeat stored the oversized marker because the body did not
    /// move for a lease (a client that stopped reading): then call [`Recorder::over_limit`]
    /// (which writes nothing more) and let the rest through uncopied.
    pub fn is_settled(&self) -> bool {
        self.progress.as_ref().is_some_and(|p| p.is_settled())
    }

    /// Ready once a streamed body has produced nothing for a whole lease: then call
    /// [`Recorder::over_limit`] and let the rest through uncopied. Registers a wake-up with `cx`
    /// until then, so an idle stream is woken for it. Never ready for [`Recorder::new`].
    pub fn poll_expired(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        match self.deadline.as_mut() {
            Some(deadline) => deadline.as_mut().poll(cx),
            None => std::task::Poll::Pending,
        }
    }

    /// Runs `fut` (reading the body) under the execution: the lease stays alive and a panic is
    /// caught (see [`Execution::run`]).
    ///
    /// # Errors
    /// The panic's payload, if `fut` panicked.
    pub async fn run<F: std::future::Future>(
        &mut self,
        fut: F,
    ) -> Result<F::Output, crate::engine::PanicPayload> {
        self.execution.run(fut).await
    }

    /// The next bytes of the body; `false` once it has passed the limit: call
    /// [`Recorder::over_limit`] then.
    pub fn data(&mut self, chunk: &[u8]) -> bool {
        if let Some(deadline) = self.deadline.as_mut() {
            let lease = self.execution.policy().lease;
            deadline.as_mut().reset(tokio::time::Instant::now() + lease);
        }
        if let Some(progress) = &self.progress {
            progress.moved(chunk.len());
        }
        self.capture.push(chunk)
    }

    /// The body passed the limit: stores the oversized marker.
    pub async fn over_limit(self) -> Recorded {
        let marker = StoredOutcome::Oversized {
            status: self.capture.status(),
            size: self.capture.size(),
        };
        self.execution.finish(marker).await
    }

    /// The body ended: stores the copy (or the marker, if it passed the limit).
    // Neither this nor `fail` is an `async fn`: one would hold the recorder twice (as its
    // argument and as the local it moves into) around the store's future.
    pub fn end(self) -> impl Future<Output = Recorded> {
        self.execution.finish(self.capture.finish())
    }

    /// The body failed before it could be stored: releases the key. The failure is logged
    /// when this is called, so await the future it returns.
    pub fn fail(self, error: &(dyn std::fmt::Display + Sync)) -> impl Future<Output = Recorded> {
        tracing::error!(
            route = self.execution.policy().route,
            error = %error,
            "idempotency: the handler's response body failed before it could be stored; the key is released"
        );
        self.execution.release()
    }

    /// The client went away before the end: reads the `rest` of the body (bounded, see the
    /// type's docs) and finishes as it ends.
    pub async fn abandon<S, B, E>(mut self, rest: S) -> Recorded
    where
        S: futures_util::Stream<Item = Result<B, E>>,
        B: AsRef<[u8]>,
        E: std::fmt::Display,
    {
        use futures_util::StreamExt;
        let deadline = tokio::time::Instant::now() + self.execution.policy().lease;
        let capture = &mut self.capture;
        let progress = self.progress.as_deref();
        let read = async {
            let mut rest = std::pin::pin!(rest);
            while let Some(chunk) = rest.next().await {
                let chunk = chunk?;
                if let Some(progress) = progress {
                    progress.moved(chunk.as_ref().len());
                }
                if !capture.push(chunk.as_ref()) {
                    break;
                }
            }
            Ok::<(), E>(())
        };
        let read = self
            .execution
            .run(tokio::time::timeout_at(deadline, read))
            .await;
        match read {
            Ok(Ok(Ok(()))) => self.end().await,
            Ok(Ok(Err(error))) => {
                let reason = error.to_string();
                self.fail(&reason).await
            }
            Ok(Err(_elapsed)) => {
                tracing::warn!(
                    route = self.execution.policy().route,
                    "idempotency: a streamed response whose client left did not end within a lease; stored as not replayable"
                );
                self.over_limit().await
            }
            Err(_panic) => self.execution.release().await,
        }
    }
}

/// A copy of a response for storing: its status, its storable headers, and its body up to a
/// limit. The response itself goes to the client untouched (as it is produced, for streams);
/// this only keeps what a replay needs, and stops keeping bytes once the body passes the limit.
///
/// ```
/// use idempotent_core::{store::StoredOutcome, __private::Capture};
/// let mut c = Capture::new(201, [("content-type", &b"text/plain"[..]), ("date", b"x")], 5);
/// assert!(c.push(b"hel"));
/// assert!(c.push(b"lo"));
/// let StoredOutcome::Response(r) = c.finish() else { unreachable!() };
/// assert_eq!((r.body.as_slice(), r.headers.len()), (&b"hello"[..], 1));
///
/// let mut c = Capture::new(200, [], 3);
/// assert!(!c.push(b"four"));
/// assert_eq!(c.finish(), StoredOutcome::Oversized { status: 200, size: 4 });
/// ```
#[derive(Debug)]
pub struct Capture {
    status: u16,
    headers: Vec<(String, Vec<u8>)>,
    body: Vec<u8>,
    limit: usize,
    size: u64,
}

impl Capture {
    /// Starts a copy of a response with `status` and `headers` (only the storable ones are
    /// kept: see [`is_stored_header`], and never a header the response's `Connection` header
    /// names, which is hop-by-hop), keeping at most `limit` body bytes.
    pub fn new<'a>(
        status: u16,
        headers: impl IntoIterator<Item = (&'a str, &'a [u8])>,
        limit: usize,
    ) -> Self {
        let mut hop_by_hop: Vec<&'a [u8]> = Vec::new();
        let mut kept: Vec<(String, Vec<u8>)> = Vec::new();
        for (name, value) in headers {
            if name.eq_ignore_ascii_case("connection") {
                hop_by_hop.extend(connection_options(value));
            } else if is_stored_header(name) {
                kept.push((name.to_ascii_lowercase(), value.to_vec()));
            }
        }
        // RFC 9110 §7.6.1: whatever `Connection` names is for this connection only; a replay
        // goes out on another one.
        if !hop_by_hop.is_empty() {
            kept.retain(|(name, _)| {
                !hop_by_hop
                    .iter()
                    .any(|hop| hop.eq_ignore_ascii_case(name.as_bytes()))
            });
        }
        Capture {
            status,
            headers: kept,
            body: Vec::new(),
            limit,
            size: 0,
        }
    }

    /// Adds the next body bytes; `false` once the body has passed the limit (the copy is
    /// dropped then, and later bytes are only counted).
    pub fn push(&mut self, chunk: &[u8]) -> bool {
        self.size += chunk.len() as u64;
        if self.is_over() {
            self.body = Vec::new();
            false
        } else {
            self.body.extend_from_slice(chunk);
            true
        }
    }

    /// Whether the body has passed the limit.
    pub fn is_over(&self) -> bool {
        self.size > self.limit as u64
    }

    /// Body bytes seen so far.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The status.
    pub fn status(&self) -> u16 {
        self.status
    }

    /// What to store: the response, or the oversized marker once it passed the limit.
    pub fn finish(self) -> StoredOutcome {
        if self.is_over() {
            StoredOutcome::Oversized {
                status: self.status,
                size: self.size,
            }
        } else {
            StoredOutcome::Response(StoredResponse {
                status: self.status,
                headers: self.headers,
                body: self.body,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans() {
        let p = Policy::default();
        assert_eq!(
            ResponsePlan::new(&p, 503, Some(10), 100),
            ResponsePlan::Release
        );
        assert_eq!(
            ResponsePlan::new(&p, 201, Some(10), 100),
            ResponsePlan::Collect
        );
        assert_eq!(
            ResponsePlan::new(&p, 200, Some(101), 100),
            ResponsePlan::Oversized { size: 101 }
        );
        assert_eq!(ResponsePlan::new(&p, 200, None, 100), ResponsePlan::Stream);
    }

    #[test]
    fn capture_limits() {
        let mut c = Capture::new(200, [], 4);
        assert!(c.push(b"ab") && c.push(b"cd"));
        assert!(!c.is_over());
        assert!(!c.push(b"e"));
        assert!(!c.push(b"fgh"));
        assert_eq!(c.size(), 8);
        assert_eq!(
            c.finish(),
            StoredOutcome::Oversized {
                status: 200,
                size: 8
            }
        );
        // Exactly at the limit is stored.
        let mut c = Capture::new(204, [], 2);
        assert!(c.push(b"ok"));
        assert!(matches!(c.finish(), StoredOutcome::Response(r) if r.body == b"ok"));
    }

    #[test]
    fn headers_named_in_connection_are_not_stored() {
        // RFC 9110 §7.6.1: the headers a `Connection` header names are hop-by-hop, whatever
        // their name, in any case, over several `Connection` lines, with empty list elements.
        let c = Capture::new(
            201,
            [
                ("Connection", &b"X-Hop, keep-alive"[..]),
                ("x-hop", b"1"),
                ("x-end", b"2"),
                ("connection", b" ,\tX-Second ,"),
                ("X-Second", b"3"),
                ("keep-alive", b"timeout=5"),
                ("x-end", b"4"),
            ],
            10,
        );
        let StoredOutcome::Response(r) = c.finish() else {
            panic!("oversized")
        };
        assert_eq!(
            r.headers,
            vec![
                ("x-end".to_owned(), b"2".to_vec()),
                ("x-end".to_owned(), b"4".to_vec())
            ]
        );
    }
}
