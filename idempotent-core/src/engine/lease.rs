//! One claimed execution: its lease, the heartbeat that extends it, and the fenced writes
//! that finish it.

use super::flight::InFlight;
use super::{Policy, Recorded};
use crate::observe::{self, Settled};
use crate::store::fence::LeaseToken;
use crate::store::record::{RecordKey, StoredOutcome};
use crate::store::{Store, StoreError};
use futures_util::FutureExt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;
use tracing::Instrument;

/// The payload of a caught panic.
pub type PanicPayload = Box<dyn std::any::Any + Send + 'static>;

/// One claimed execution: holds the record's lease until the outcome is stored or the key
/// released, extends the lease while it runs (a heartbeat after half the lease), and counts
/// towards [`Engine::drain`](super::Engine::drain).
///
/// Finish it with [`Execution::finish`] or [`Execution::release`]. Dropping it unfinished
/// stops its heartbeat and leaves the record in progress until the lease runs out (logged):
/// that is what a crash does too, and it never lets a retry run while the work may be done.
pub struct Execution {
    /// Boxed, so the futures that hold an execution (the handler's run, storing its response)
    /// each hold a pointer: moved through their nested states it would be copied at each
    /// level, making the boxed execution future of a first execution larger than 3 KiB.
    inner: Box<Inner>,
}

/// What an [`Execution`] holds.
struct Inner {
    /// The request's span ([`crate::observe`]).
    span: tracing::Span,
    /// Whether this execution counts its own outcome (not when a transactional execution,
    /// which counts it, holds it).
    observed: bool,
    slot: InFlight,
    /// When the claim was sent (local clock), no later than the store started the lease: the
    /// lease's first half ends at most half a lease after it.
    claimed_at: tokio::time::Instant,
    key: RecordKey,
    /// The claiming request's fingerprint (what a replay cache keeps beside the outcome).
    fingerprint: crate::fingerprint::Fingerprint,
    token: LeaseToken,
    policy: Policy,
    heartbeat: Heartbeat,
    finished: bool,
    /// A streamed response's progress, watched by the heartbeat ([`Execution::watch`]).
    progress: Option<Arc<Progress>>,
}

impl std::fmt::Debug for Execution {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Execution")
            .field("token", &self.inner.token)
            .field("policy", &self.inner.policy)
            .finish_non_exhaustive()
    }
}

impl Execution {
    /// The execution of a claim that `slot` counted, sent at `claimed_at`; not observed until
    /// [`Execution::observe`] gives it its span.
    pub(super) fn claimed(
        slot: InFlight,
        claimed_at: tokio::time::Instant,
        key: RecordKey,
        fingerprint: crate::fingerprint::Fingerprint,
        token: LeaseToken,
        policy: Policy,
    ) -> Self {
        Execution {
            inner: Box::new(Inner {
                span: tracing::Span::none(),
                observed: false,
                slot,
                claimed_at,
                key,
                fingerprint,
                token,
                policy,
                heartbeat: Heartbeat::default(),
                finished: false,
                progress: None,
            }),
        }
    }

    /// Runs under the request's `span` and counts its own outcome ([`crate::observe`]).
    pub(super) fn observe(&mut self, span: tracing::Span) {
        self.inner.span = span;
        self.inner.observed = true;
    }

    /// The route's policy this execution runs under.
    pub fn policy(&self) -> &Policy {
        &self.inner.policy
    }

    /// The record's (scope, key).
    pub fn key(&self) -> &RecordKey {
        &self.inner.key
    }

    /// The claiming request's fingerprint.
    #[cfg_attr(
        not(any(feature = "sqlite", feature = "postgres", feature = "mysql")),
        allow(dead_code)
    )]
    pub(crate) fn fingerprint(&self) -> crate::fingerprint::Fingerprint {
        self.inner.fingerprint
    }

    /// The engine that claimed it (for the transactional paths' replay cache).
    #[cfg_attr(
        not(any(feature = "sqlite", feature = "postgres", feature = "mysql")),
        allow(dead_code)
    )]
    pub(crate) fn engine(&self) -> &std::sync::Arc<super::Inner> {
        &self.inner.slot.engine
    }

    /// The lease token this execution holds.
    #[cfg_attr(
        not(any(feature = "sqlite", feature = "postgres", feature = "mysql")),
        allow(dead_code)
    )]
    pub(crate) fn token(&self) -> LeaseToken {
        self.inner.token
    }

    /// Runs `fut` to completion while keeping the lease alive; a panic in it is caught and
    /// returned (finish with [`Execution::release`], then resume it).
    ///
    /// # Errors
    /// The panic's payload, if `fut` panicked.
    pub async fn run<F: Future>(&mut self, fut: F) -> Result<F::Output, PanicPayload> {
        let fut = fut.instrument(self.inner.span.clone());
        let mut fut = std::pin::pin!(AssertUnwindSafe(fut).catch_unwind());
        std::future::poll_fn(|cx| {
            if let Poll::Ready(out) = fut.as_mut().poll(cx) {
                return Poll::Ready(out);
            }
            self.poll_heartbeat(cx);
            Poll::Pending
        })
        .await
    }

    /// Keeps the lease alive from a `poll` function (a response body the adapter streams):
    /// after half the lease it starts the heartbeat task, which then extends the lease every
    /// half lease until this execution is finished or dropped. Registers a wake-up with `cx`
    /// until then. Needs a tokio runtime with timers.
    pub fn poll_heartbeat(&mut self, cx: &mut Context<'_>) {
        let first = self.first_extension();
        if self.inner.heartbeat.due(self.inner.finished, first, cx) {
            self.start_heartbeat(Duration::ZERO);
        }
    }

    /// Starts the heartbeat task now (its first extension after half the lease), for work
    /// whose progress does not depend on this execution being polled: a response body the
    /// client may stop reading for a while. No-op if it runs already.
    pub fn keep_alive(&mut self) {
        let first_after = self
            .first_extension()
            .saturating_duration_since(tokio::time::Instant::now());
        self.start_heartbeat(first_after);
    }

    /// Starts the heartbeat now (as [`Execution::keep_alive`]) watching `progress`: a response
    /// body on its way to a client that may stop reading. When it has not moved for a whole
    /// lease (nothing sent: the client stopped reading, so the server stopped polling the
    /// body; or the body produced nothing), the heartbeat stops renewing and settles the
    /// record itself with the "not stored" marker ([`StoredOutcome::Oversized`], a 410 on
    /// retry), as the body would after a lease of silence if it were polled. The write that
    /// finishes this execution later ([`Execution::finish`], [`Execution::release`]) then
    /// writes nothing and reports what the heartbeat did.
    pub(crate) fn watch(&mut self, progress: Arc<Progress>) {
        self.inner.progress = Some(progress);
        if self.inner.heartbeat.task.is_some() {
            // Started while the handler ran (it ran half a lease), without the progress: start
            // it again, watching (it renews at once).
            self.inner.heartbeat = Heartbeat::default();
            self.start_heartbeat(Duration::ZERO);
        } else {
            self.keep_alive();
        }
    }

    /// When the first extension is due: half a lease after the claim was sent.
    fn first_extension(&self) -> tokio::time::Instant {
        self.inner.claimed_at + self.inner.policy.lease / 2
    }

    fn start_heartbeat(&mut self, first_after: Duration) {
        start_heartbeat(
            &mut self.inner.heartbeat,
            self.inner.finished,
            &self.inner.slot.engine.store,
            &self.inner.key,
            self.inner.token,
            &self.inner.policy,
            first_after,
            self.inner.progress.as_ref(),
        );
    }

    /// Finishes with the handler's outcome: stores it if the policy stores its status, else
    /// releases the key. The lease is extended while the write is on its way, as while the
    /// handler ran, so a slow write does not let a retry take the record over. Store errors are
    /// retried (bounded, within the lease); if it still fails the record stays in progress
    /// until its lease ends ([`Recorded::Failed`], logged).
    // Not an `async fn`: one keeps its by-value arguments in its future twice (as arguments
    // and as the locals they move into), and this future is nested in every first execution's.
    #[allow(
        clippy::manual_async_fn,
        reason = "an async fn holds its arguments twice"
    )]
    pub fn finish(mut self, outcome: StoredOutcome) -> impl Future<Output = Recorded> {
        async move {
            let stores = self.inner.policy.stores(outcome.status());
            let span = self.inner.span.clone();
            // Before the complete is sent: the record then expires no sooner than a ttl after
            // this (the store's now is later), so a kept copy never outlives it.
            let sent = std::time::Instant::now();
            let streamed = self.inner.progress.is_some();
            let recorded = self
                .write(stores.then_some(&outcome))
                .instrument(span.clone())
                .await;
            if self.inner.observed {
                observe::settled(&span, self.inner.policy.route, (&recorded).into());
            }
            // Kept only after this complete succeeded (a streamed response's record may have
            // been settled by the heartbeat instead: not kept).
            if stores
                && !streamed
                && matches!(recorded, Recorded::Stored)
                && let Some(cache) = &self.inner.slot.engine.cache
            {
                let inner = &*self.inner;
                cache.keep(
                    super::cache::Kept::Own,
                    &inner.key,
                    inner.fingerprint,
                    outcome,
                    sent,
                    inner.policy.ttl,
                );
            }
            self.done();
            recorded
        }
    }

    /// Finishes without an outcome to store (a panic, a response body that failed before it
    /// could be stored): releases the key so a retry runs again. Failures are retried and
    /// logged like [`Execution::finish`]'s.
    // Not an `async fn`, for the reason `finish` gives.
    #[allow(
        clippy::manual_async_fn,
        reason = "an async fn holds its arguments twice"
    )]
    pub fn release(mut self) -> impl Future<Output = Recorded> {
        async move {
            let span = self.inner.span.clone();
            let recorded = self.write(None).instrument(span.clone()).await;
            if self.inner.observed {
                let settled = match &recorded {
                    Recorded::Failed(StoreError::StaleLease) => Settled::FenceRefused,
                    Recorded::Failed(_) => Settled::ReleaseFailed,
                    other => other.into(),
                };
                observe::settled(&span, self.inner.policy.route, settled);
            }
            self.done();
            recorded
        }
    }

    /// Stores `outcome` (`Some`) or releases the key (`None`), fenced, retried within the
    /// lease; a final failure is logged and leaves the record in progress until its lease ends.
    async fn write(&mut self, outcome: Option<&StoredOutcome>) -> Recorded {
        if let Some(progress) = &self.inner.progress
            && let Some(stored) = progress.finishing().await
        {
            // The heartbeat settled the record after a lease of silence.
            return if stored {
                Recorded::Stored
            } else {
                Recorded::Failed(StoreError::StaleLease)
            };
        }
        let first = self.first_extension();
        let Inner {
            slot,
            key,
            token,
            policy,
            heartbeat,
            finished,
            progress,
            ..
        } = &mut *self.inner;
        let store = &slot.engine.store;
        let failed = std::sync::atomic::AtomicBool::new(false);
        // Each attempt is bounded: the heartbeat below keeps the lease while it waits, so an
        // attempt that never answers (a half-open connection) would otherwise hold the record
        // in progress, and `Engine::drain`, for as long as it hangs.
        let bound = write_bound(policy.lease);
        let write = fenced_write(
            policy,
            || async {
                let (what, attempt) = match outcome {
                    Some(outcome) => {
                        let complete = store.complete(key, *token, outcome, policy.ttl);
                        ("complete", observe::timed("complete", complete))
                    }
                    None => (
                        "release",
                        observe::timed("release", store.release(key, *token)),
                    ),
                };
                tokio::time::timeout(bound, attempt)
                    .await
                    .unwrap_or_else(|_| Err(StoreError::unavailable(NoAnswer { what, bound })))
            },
            || failed.store(true, Ordering::Relaxed),
        );
        let mut write = std::pin::pin!(write);
        // The lease is kept while the write is on its way, as while the handler ran: a write
        // that hangs past the lease (a stuck connection, a slow replica acknowledgement) must
        // not let a retry take the record over and run the handler again. The heartbeat
        // starts when the first extension is due, or at once when an attempt failed.
        let result = std::future::poll_fn(|cx| {
            if let Poll::Ready(result) = write.as_mut().poll(cx) {
                return Poll::Ready(result);
            }
            if failed.load(Ordering::Relaxed) || heartbeat.due(*finished, first, cx) {
                start_heartbeat(
                    heartbeat,
                    *finished,
                    store,
                    key,
                    *token,
                    policy,
                    Duration::ZERO,
                    progress.as_ref(),
                );
            }
            Poll::Pending
        })
        .await;
        if result.is_ok() {
            // Waiters on this record in this process look again at once.
            slot.engine.changed(key);
        }
        match (result, outcome) {
            (Ok(()), Some(_)) => Recorded::Stored,
            (Ok(()), None) => Recorded::Released,
            (Err(StoreError::StaleLease), _) => {
                // Logged by `fenced_write` when an earlier attempt may have been applied.
                tracing::warn!(
                    route = policy.route,
                    "idempotency: the fence refused this execution's write: its lease was taken over"
                );
                Recorded::Failed(StoreError::StaleLease)
            }
            (Err(error), Some(outcome)) => {
                tracing::error!(
                    route = policy.route,
                    error = %error,
                    status = outcome.status(),
                    "idempotency: the outcome could not be stored; the record stays in progress until its lease ends, then a retry runs the handler again"
                );
                Recorded::Failed(error)
            }
            (Err(error), None) => {
                tracing::error!(
                    route = policy.route,
                    error = %error,
                    "idempotency: the key could not be released; the record stays in progress until its lease ends"
                );
                Recorded::Failed(error)
            }
        }
    }

    fn done(&mut self) {
        self.inner.finished = true;
        self.inner.heartbeat = Heartbeat::default();
    }

    /// Ends this execution without a write of its own: the caller settled the record (a
    /// transaction that completed it committed, or a write whose fate is unknown was logged).
    #[cfg_attr(
        not(any(feature = "sqlite", feature = "postgres", feature = "mysql")),
        allow(dead_code)
    )]
    pub(crate) fn settle(mut self) {
        self.done();
    }
}

impl Drop for Execution {
    fn drop(&mut self) {
        if !self.inner.finished {
            self.inner
                .slot
                .engine
                .flight
                .dropped
                .fetch_add(1, Ordering::SeqCst);
            tracing::warn!(
                route = self.inner.policy.route,
                "idempotency: an execution was dropped before its outcome was stored; its record stays in progress until its lease ends"
            );
        }
    }
}

/// Starts an execution's heartbeat task, unless it runs already or the execution finished.
#[allow(
    clippy::too_many_arguments,
    reason = "the parts of an execution the task copies, borrowed apart"
)]
fn start_heartbeat(
    state: &mut Heartbeat,
    finished: bool,
    store: &Arc<dyn Store>,
    key: &RecordKey,
    token: LeaseToken,
    policy: &Policy,
    first_after: Duration,
    progress: Option<&Arc<Progress>>,
) {
    if state.task.is_some() || finished {
        return;
    }
    state.timer = None;
    let task = tokio::spawn(heartbeat(
        Arc::clone(store),
        key.clone(),
        token,
        *policy,
        first_after,
        progress.cloned(),
    ));
    state.task = Some(AbortOnDrop(task));
}

/// A streamed response's progress on its way to the client, shared by the recorder that
/// feeds it ([`Progress::moved`]) and the execution's heartbeat, which settles the record
/// when nothing has moved for a lease ([`Execution::watch`]). It also decides which of the
/// two writes the record: the recorder, or the heartbeat after a lease of silence.
#[derive(Debug)]
pub(crate) struct Progress {
    since: tokio::time::Instant,
    /// When something last moved, in ms since `since`.
    moved_ms: AtomicU64,
    /// Body bytes sent so far.
    size: AtomicU64,
    status: u16,
    /// [`RECORDING`], [`SETTLING`], [`FINISHING`], [`SETTLED`] or [`SETTLE_FAILED`].
    state: AtomicU8,
    settled: tokio::sync::Notify,
}

/// The recorder may still write; the heartbeat may settle.
const RECORDING: u8 = 0;
/// The heartbeat is writing the marker.
const SETTLING: u8 = 1;
/// The recorder writes (finish or release); the heartbeat only renews.
const FINISHING: u8 = 2;
/// The heartbeat stored the marker.
const SETTLED: u8 = 3;
/// The heartbeat's marker was refused by the fence: the record was taken over.
const SETTLE_FAILED: u8 = 4;

impl Progress {
    /// The progress of a response with `status`, nothing sent yet.
    pub(crate) fn new(status: u16) -> Arc<Self> {
        Arc::new(Progress {
            since: tokio::time::Instant::now(),
            moved_ms: AtomicU64::new(0),
            size: AtomicU64::new(0),
            status,
            state: AtomicU8::new(RECORDING),
            settled: tokio::sync::Notify::new(),
        })
    }

    /// `bytes` more went out (or were read, for a client that left): the body moves.
    pub(crate) fn moved(&self, bytes: usize) {
        self.size.fetch_add(bytes as u64, Ordering::Relaxed);
        let ms = u64::try_from(self.since.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.moved_ms.store(ms, Ordering::Relaxed);
    }

    /// Whether the heartbeat settled the record (the recorder has nothing more to record).
    pub(crate) fn is_settled(&self) -> bool {
        matches!(self.state.load(Ordering::Acquire), SETTLED | SETTLE_FAILED)
    }

    /// How long nothing has moved.
    fn silent_for(&self) -> Duration {
        let moved = Duration::from_millis(self.moved_ms.load(Ordering::Relaxed));
        self.since.elapsed().saturating_sub(moved)
    }

    /// The recorder is about to write: `None` when it may (from now on the heartbeat only
    /// renews), `Some(stored)` when the heartbeat settled the record (after its write, if it
    /// was on its way).
    async fn finishing(&self) -> Option<bool> {
        loop {
            let notified = self.settled.notified();
            match self.state.compare_exchange(
                RECORDING,
                FINISHING,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) | Err(FINISHING) => return None,
                Err(SETTLED) => return Some(true),
                Err(SETTLE_FAILED) => return Some(false),
                // The heartbeat's write is on its way: its answer, then look again.
                Err(_) => notified.await,
            }
        }
    }

    /// The heartbeat takes the write, if the recorder has not.
    fn try_settle(&self) -> bool {
        self.state
            .compare_exchange(RECORDING, SETTLING, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// The heartbeat's write ended in `state` ([`RECORDING`] again when it failed and may be
    /// tried again).
    fn settle_ended(&self, state: u8) {
        self.state.store(state, Ordering::Release);
        self.settled.notify_waiters();
    }

    /// The marker the heartbeat stores.
    fn marker(&self) -> StoredOutcome {
        StoredOutcome::Oversized {
            status: self.status,
            size: self.size.load(Ordering::Relaxed),
        }
    }
}

/// Runs a fenced store write, retrying transient failures with exponential backoff for at
/// most half the lease (the other half is the margin before a retry could take over);
/// `keep_alive` runs at each failure (its caller starts the heartbeat), so the lease does
/// not lapse while it retries. A stale lease is final.
async fn fenced_write<F, Fut>(
    policy: &Policy,
    mut call: F,
    mut keep_alive: impl FnMut(),
) -> Result<(), StoreError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(), StoreError>>,
{
    let mut attempts = 0_u32;
    let mut retry: Option<(tokio::time::Instant, Duration)> = None;
    loop {
        attempts += 1;
        // A retry goes on a connection the store opens for it: the one before may have gone
        // silent, and so may its pool's idle ones.
        let answer = if attempts > 1 {
            crate::store::renew::on_fresh_connection(call()).await
        } else {
            call().await
        };
        match answer {
            Ok(()) => return Ok(()),
            Err(StoreError::StaleLease) if attempts > 1 => {
                tracing::warn!(
                    route = policy.route,
                    attempts,
                    "idempotency: fence refused a retried write: the lease was taken over, or an earlier attempt was applied before its answer was lost"
                );
                return Err(StoreError::StaleLease);
            }
            Err(e @ StoreError::StaleLease) => return Err(e),
            Err(e) => {
                // The clock is read only once something failed.
                let (deadline, backoff) = retry.get_or_insert_with(|| {
                    let now = tokio::time::Instant::now();
                    (
                        now.checked_add(policy.lease / 2).unwrap_or(now),
                        Duration::from_millis(10),
                    )
                });
                if tokio::time::Instant::now() + *backoff >= *deadline {
                    return Err(e);
                }
                keep_alive();
                tracing::warn!(route = policy.route, error = %e, attempts, "idempotency: store write failed; retrying");
                tokio::time::sleep(*backoff).await;
                *backoff = (*backoff * 2).min(Duration::from_secs(1));
            }
        }
    }
}

/// How long one store write that finishes an execution (a complete, a release, a complete
/// and COMMIT) may wait for its answer: a lease, and at least 10 s. Whether a write given up
/// on applied is unknown; its token fences it either way.
pub(crate) fn write_bound(lease: Duration) -> Duration {
    lease.max(Duration::from_secs(10))
}

/// A store write that got no answer in time.
#[derive(Debug, thiserror::Error)]
#[error("{what} had no answer within {bound:?}")]
pub(crate) struct NoAnswer {
    /// The write.
    pub(crate) what: &'static str,
    /// How long it was given.
    pub(crate) bound: Duration,
}

/// The lazily started heartbeat of an execution.
#[derive(Default)]
struct Heartbeat {
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    task: Option<AbortOnDrop>,
}

impl Heartbeat {
    /// Whether the heartbeat task should start now: it does not run yet, the execution is not
    /// finished, and `first` (when the first extension is due) has come. Registers a wake-up
    /// with `cx` for `first` until then.
    fn due(&mut self, finished: bool, first: tokio::time::Instant, cx: &mut Context<'_>) -> bool {
        if self.task.is_some() || finished {
            return false;
        }
        let timer = self
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(first)));
        timer.as_mut().poll(cx).is_ready()
    }
}

/// A task that is aborted when this handle is dropped, so it never outlives its owner.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

async fn heartbeat(
    store: Arc<dyn Store>,
    key: RecordKey,
    token: LeaseToken,
    policy: Policy,
    first_after: Duration,
    progress: Option<Arc<Progress>>,
) {
    let (lease, route) = (policy.lease, policy.route);
    let half = lease / 2;
    tokio::time::sleep(first_after).await;
    // Set when settling a silent body failed: the next round waits half a lease, not the
    // silence's end (which has passed), before it tries again.
    let mut settle_failed = false;
    loop {
        // A streamed body that has not moved for a lease: settle instead of renewing.
        if let Some(progress) = &progress
            && progress.silent_for() >= lease
            && progress.try_settle()
        {
            let marker = progress.marker();
            // Nothing renews while it is on its way: it gets what a renewal's first attempt
            // gets, and the renewal below follows if it had no answer.
            let bound = crate::store::renew::first_attempt(lease);
            let write = store.complete(&key, token, &marker, policy.ttl);
            settle_failed = true;
            match tokio::time::timeout(bound, write).await {
                Ok(Ok(())) => {
                    if let Some(changes) = store.changes() {
                        changes.notify_key(&key);
                    }
                    tracing::warn!(
                        route,
                        "idempotency: a streamed response did not move for a lease (its client stopped reading, or it produced nothing); stored as not replayable"
                    );
                    progress.settle_ended(SETTLED);
                    return;
                }
                Ok(Err(StoreError::StaleLease)) => {
                    progress.settle_ended(SETTLE_FAILED);
                    return;
                }
                // Not stored: the recorder may still finish; renew, and try again next time.
                Ok(Err(error)) => {
                    tracing::warn!(route, error = %error, "idempotency: storing a silent stream's marker failed; retrying");
                    progress.settle_ended(RECORDING);
                }
                Err(_) => progress.settle_ended(RECORDING),
            }
        }
        // Bounded (`Store::renew`): a silent connection costs an eighth of the lease, then the
        // store tries another, within seven sixteenths of the lease.
        match observe::timed("extend", store.renew(&key, token, lease)).await {
            // The next renewal in half a lease, or sooner when a watched body's lease of
            // silence ends first.
            Ok(_) => {
                let wake = match &progress {
                    Some(p) if !settle_failed && p.state.load(Ordering::Acquire) == RECORDING => {
                        half.min(lease.saturating_sub(p.silent_for()))
                            .max(Duration::from_millis(10))
                    }
                    _ => half,
                };
                settle_failed = false;
                tokio::time::sleep(wake).await;
            }
            // Someone took over (`complete` will report the stale lease), or the outcome was
            // stored while this renewal was on its way: stop.
            Err(StoreError::StaleLease) => {
                tracing::warn!(
                    route,
                    "idempotency: a lease renewal was refused: the lease was taken over, or the outcome was stored meanwhile"
                );
                return;
            }
            // A passing store error: try again soon. A renewal that waited out its whole
            // bound leaves a sixteenth of the lease; one that failed at once, more.
            Err(error) => {
                tracing::warn!(route, error = %error, "idempotency: heartbeat failed; retrying");
                tokio::time::sleep(lease / 32).await;
            }
        }
    }
}
