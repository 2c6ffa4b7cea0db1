//! Waiting for a running duplicate's answer ([`Policy::wait`]) instead of answering
//! "in progress" at once.
//!
//! A request that finds its record in progress, on a route with a `wait`, takes a place (at
//! most [`EngineBuilder::max_waiting_per_key`](super::EngineBuilder::max_waiting_per_key) per
//! record and [`EngineBuilder::max_waiting`](super::EngineBuilder::max_waiting) in the engine;
//! past either it is answered "in progress" at once), watches its record's change
//! notifications ([`crate::store::Changes`]) and claims again whenever it is woken, when its
//! store's polling interval passes, and when the other attempt's lease runs out. Each claim
//! decides as any request's would: a stored outcome replays, a released (or lapsed) record is
//! claimed and the handler runs, a record still in progress keeps it waiting. At its deadline
//! it is answered "in progress" (409), as without a wait. It holds no store connection while
//! it waits, only its place.

use super::Inner;
use crate::observe;
use crate::store::record::RecordKey;
use crate::store::{Changes, Watch};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::time::Instant;

/// Default [`EngineBuilder::max_waiting_per_key`](super::EngineBuilder::max_waiting_per_key):
/// 32 requests wait on one record in one engine.
pub const DEFAULT_MAX_WAITING_PER_KEY: usize = 32;
/// Default [`EngineBuilder::max_waiting`](super::EngineBuilder::max_waiting): 1,024 requests
/// wait in one engine.
pub const DEFAULT_MAX_WAITING: usize = 1024;

/// Resolves when the request's client is gone: its wait ends at once (the HTTP adapters' wait
/// runs inside a detached future, which a client going away does not drop).
pub(crate) type Gone = Pin<Box<dyn Future<Output = ()> + Send>>;

/// How a wait ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WaitEnd {
    /// The record was settled (replayed, or claimed to run).
    Replayed,
    Ran,
    /// Still in progress at the deadline.
    TimedOut,
    /// No place: too many waiters.
    OverBound,
    /// The client went away.
    Gone,
    /// Something else answered (a mismatch after a take-over, a store error, a drain).
    Other,
}

impl WaitEnd {
    fn label(self) -> &'static str {
        match self {
            WaitEnd::Replayed => "replayed",
            WaitEnd::Ran => "ran",
            WaitEnd::TimedOut => "timed_out",
            WaitEnd::OverBound => "over_bound",
            WaitEnd::Gone => "gone",
            WaitEnd::Other => "other",
        }
    }
}

/// One waiting request: its place, its watch and its clock.
pub(crate) struct Waiting {
    inner: Arc<Inner>,
    watch: Watch,
    route: &'static str,
    started: Instant,
    deadline: Instant,
    pause: Duration,
    cap: Duration,
    ended: bool,
}

/// What one pause ended with.
pub(crate) enum Pause {
    /// Look at the store again.
    Again,
    /// The deadline passed.
    Deadline,
    /// The client went away.
    Gone,
}

impl Inner {
    /// The hub that wakes this engine's waiters: the store's, else the engine's own.
    pub(crate) fn changes(&self) -> &Changes {
        self.store.changes().unwrap_or(&self.local_changes)
    }

    /// Wakes the waiters on `key` in this process (after this engine completed or released
    /// it; remote stores also notify other instances themselves).
    pub(crate) fn changed(&self, key: &RecordKey) {
        self.changes().notify_key(key);
    }
}

impl Waiting {
    /// A place to wait on `key` for up to `wait`, or `None` past a bound (counted).
    pub(crate) fn start(
        inner: &Arc<Inner>,
        key: &RecordKey,
        wait: Duration,
        route: &'static str,
    ) -> Option<Waiting> {
        let total = inner.waiting.fetch_add(1, Ordering::AcqRel);
        let place = (total < inner.max_waiting)
            .then(|| inner.changes().watch(key, inner.max_waiting_per_key))
            .flatten();
        let Some(watch) = place else {
            inner.waiting.fetch_sub(1, Ordering::AcqRel);
            observe::wait_ended(route, WaitEnd::OverBound.label(), Duration::ZERO);
            tracing::debug!(route, "idempotency: too many waiters; answered in progress");
            return None;
        };
        let changes = inner.changes();
        let (first, cap) = (changes.first_poll(), changes.poll_cap());
        let now = Instant::now();
        observe::event(route, "wait_started");
        Some(Waiting {
            inner: Arc::clone(inner),
            watch,
            route,
            started: now,
            deadline: now + wait,
            pause: first,
            cap,
            ended: false,
        })
    }

    /// Marks the notifications so far as seen: call before each look at the store, so one
    /// sent while it is on its way still wakes the pause after it.
    pub(crate) fn mark(&mut self) {
        self.watch.mark();
    }

    /// Time left until the deadline.
    pub(crate) fn left(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }

    /// Sleeps until a notification, the next poll, the other attempt's lease end
    /// (`retry_after`), the deadline, or `gone`.
    pub(crate) async fn pause(&mut self, retry_after: Duration, gone: &mut Option<Gone>) -> Pause {
        let left = self.left();
        if left.is_zero() {
            return Pause::Deadline;
        }
        // Just past the lease's end, so the claim then finds it ended and takes over.
        let lease_end = retry_after.saturating_add(Duration::from_millis(5));
        let sleep = self.pause.min(lease_end).min(left);
        self.pause = self.pause.saturating_mul(2).min(self.cap);
        let gone_fut = async {
            match gone.as_mut() {
                Some(gone) => gone.await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = self.watch.changed() => Pause::Again,
            () = tokio::time::sleep(sleep) => {
                if sleep == left { Pause::Deadline } else { Pause::Again }
            }
            () = gone_fut => Pause::Gone,
        }
    }

    /// Counts how the wait ended, with its time.
    pub(crate) fn end(mut self, end: WaitEnd) {
        self.ended = true;
        observe::wait_ended(self.route, end.label(), self.started.elapsed());
        tracing::debug!(route = self.route, outcome = end.label(), waited = ?self.started.elapsed(), "idempotency: wait ended");
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.inner.waiting.fetch_sub(1, Ordering::AcqRel);
        if !self.ended {
            // Dropped mid-wait: its caller went away.
            observe::wait_ended(self.route, WaitEnd::Gone.label(), self.started.elapsed());
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::engine::{Begin, Engine, ExecuteRequest, Policy};
    use crate::fingerprint::{Fingerprint, FingerprintInput};
    use crate::key::IdempotencyKey;
    use crate::scope::Scope;
    use crate::store::{MemoryStore, StoredResponse};
    use std::time::Duration;

    fn request(key: &str) -> ExecuteRequest {
        ExecuteRequest {
            scope: Scope::new("acct").unwrap(),
            key: IdempotencyKey::parse(key.as_bytes()),
            fingerprint: Fingerprint::compute(&FingerprintInput {
                method: "POST",
                path: "/w",
                query: None,
                content_type: None,
                body: b"",
            }),
        }
    }

    fn waits(wait: Duration) -> Policy {
        Policy {
            lease: Duration::from_secs(10),
            wait,
            ..Policy::default()
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_waiter_replays_the_answer_and_one_runs_after_a_release() {
        let engine = Engine::new(MemoryStore::new());
        let policy = waits(Duration::from_secs(5));
        let Begin::Claimed(first) = engine.begin(request("k"), &policy).await else {
            panic!("the first claims")
        };
        let waiter = {
            let engine = engine.clone();
            tokio::spawn(async move { engine.begin(request("k"), &policy).await })
        };
        while engine.waiting() == 0 {
            tokio::task::yield_now().await;
        }
        first.finish(StoredResponse::new(201, "ch_1").into()).await;
        match waiter.await.unwrap() {
            Begin::Replay(outcome) => assert_eq!(outcome.status(), 201),
            other => panic!("expected the first's answer, got {other:?}"),
        }
        assert_eq!(engine.waiting(), 0);

        // Released (a 5xx): of two waiters exactly one runs, the other replays its answer.
        let Begin::Claimed(first) = engine.begin(request("r"), &policy).await else {
            panic!("the first claims")
        };
        let spawn = || {
            let engine = engine.clone();
            tokio::spawn(async move {
                match engine.begin(request("r"), &policy).await {
                    Begin::Claimed(execution) => {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        execution
                            .finish(StoredResponse::new(201, "ran").into())
                            .await;
                        "ran"
                    }
                    Begin::Replay(_) => "replayed",
                    other => panic!("{other:?}"),
                }
            })
        };
        let (a, b) = (spawn(), spawn());
        while engine.waiting() < 2 {
            tokio::task::yield_now().await;
        }
        first.release().await;
        let mut ends = [a.await.unwrap(), b.await.unwrap()];
        ends.sort_unstable();
        assert_eq!(ends, ["ran", "replayed"]);
    }

    /// The first attempt's process dies (its execution dropped: no heartbeat, no answer):
    /// a waiter whose wait ends before the lease does gets "in progress" at its deadline; one
    /// whose wait outlasts the lease takes the record over and runs; neither hangs.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dead_first_attempt_ends_waits_at_the_deadline_or_the_lease() {
        let engine = Engine::new(MemoryStore::new());
        let policy = Policy {
            lease: Duration::from_millis(600),
            wait: Duration::from_millis(200),
            ..Policy::default()
        };
        let Begin::Claimed(first) = engine.begin(request("dead"), &policy).await else {
            panic!("the first claims")
        };
        drop(first);
        let started = tokio::time::Instant::now();
        let short = engine.begin(request("dead"), &policy).await;
        assert!(matches!(short, Begin::InProgress { .. }), "{short:?}");
        assert!(started.elapsed() >= Duration::from_millis(200));
        let long = Policy {
            wait: Duration::from_millis(600),
            ..policy
        };
        let taken =
            tokio::time::timeout(Duration::from_secs(5), engine.begin(request("dead"), &long))
                .await
                .expect("the waiter hung");
        assert!(matches!(taken, Begin::Claimed(_)), "{taken:?}");
        // It took the record over once the lease ended (600 ms after the claim).
        assert!(
            started.elapsed() >= Duration::from_millis(390),
            "{:?}",
            started.elapsed()
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn deadlines_bounds_and_dropped_waits() {
        let engine = Engine::builder(MemoryStore::new())
            .max_waiting_per_key(2)
            .build()
            .unwrap();
        let policy = waits(Duration::from_millis(300));
        let Begin::Claimed(_first) = engine.begin(request("d"), &policy).await else {
            panic!("the first claims")
        };
        // At the deadline: in progress, as without a wait.
        let started = tokio::time::Instant::now();
        assert!(matches!(
            engine.begin(request("d"), &policy).await,
            Begin::InProgress { .. }
        ));
        assert!(started.elapsed() >= Duration::from_millis(300));
        // Past the bound of 2 per key: in progress while both places are taken.
        let long = waits(Duration::from_secs(5));
        let spawn = || {
            let engine = engine.clone();
            tokio::spawn(async move { engine.begin(request("d"), &long).await })
        };
        let (a, b) = (spawn(), spawn());
        while engine.waiting() < 2 {
            tokio::task::yield_now().await;
        }
        let third = engine.begin(request("d"), &long).await;
        assert!(matches!(third, Begin::InProgress { .. }), "{third:?}");
        assert_eq!(engine.waiting(), 2, "the refused one took no place");
        // A dropped wait gives its place back.
        a.abort();
        b.abort();
        let _ = (a.await, b.await);
        assert_eq!(engine.waiting(), 0);
        // A wait longer than the lease is refused.
        let refused = engine
            .begin(
                request("d"),
                &Policy {
                    wait: Duration::from_secs(11),
                    ..long
                },
            )
            .await;
        assert!(matches!(refused, Begin::Misconfigured(_)), "{refused:?}");
    }
}
