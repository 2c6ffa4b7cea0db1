//! Engine behaviour on the real memory store, with real tasks and real time.
#![allow(clippy::unwrap_used)] // tests unwrap freely

use idempotent_core::__private::Detached;
use idempotent_core::{clock::*, engine::*, fingerprint::*, store::*, *};
use idempotent_tests::execute::{Execute, Handled, Outcome};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

fn request(scope: &str, key: &str, body: &str) -> ExecuteRequest {
    ExecuteRequest {
        scope: Scope::new(scope).unwrap(),
        key: IdempotencyKey::parse(key.as_bytes()),
        fingerprint: Fingerprint::compute(&FingerprintInput {
            method: "POST",
            path: "/t",
            query: None,
            content_type: Some("application/json"),
            body: body.as_bytes(),
        }),
    }
}

fn record_key(scope: &str, key: &str) -> RecordKey {
    RecordKey::new(
        Scope::new(scope).unwrap(),
        IdempotencyKey::parse(key.as_bytes()).unwrap(),
    )
}

fn handled(status: u16) -> Handled<u16> {
    Handled {
        value: status,
        record: StoredResponse::new(status, format!("s{status}")).into(),
    }
}

#[tokio::test]
async fn replay_never_calls_the_handler() {
    let engine = Engine::new(MemoryStore::new());
    let calls = AtomicUsize::new(0);
    let policy = Policy::default();
    for i in 0..5 {
        let out = engine
            .execute(request("a", "k", "{}"), &policy, || async {
                calls.fetch_add(1, Ordering::SeqCst);
                handled(201)
            })
            .await;
        match (i, out) {
            (
                0,
                Outcome::Executed {
                    value: 201,
                    recorded: Recorded::Stored,
                },
            ) => {}
            (_, Outcome::Replayed(StoredOutcome::Response(r))) if i > 0 => {
                assert_eq!((r.status, r.body.as_slice()), (201, &b"s201"[..]));
            }
            (i, other) => panic!("attempt {i}: {other:?}"),
        }
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn server_errors_and_retry_statuses_release_the_key() {
    let engine = Engine::new(MemoryStore::new());
    let calls = AtomicUsize::new(0);
    for status in [500, 503, 409, 429, 408, 425] {
        for _ in 0..2 {
            let out = engine
                .execute(
                    request("a", &format!("k{status}"), "{}"),
                    &Policy::default(),
                    || async {
                        calls.fetch_add(1, Ordering::SeqCst);
                        handled(status)
                    },
                )
                .await;
            assert!(
                matches!(
                    out,
                    Outcome::Executed {
                        recorded: Recorded::Released,
                        ..
                    }
                ),
                "{status}"
            );
        }
    }
    assert_eq!(calls.load(Ordering::SeqCst), 12, "every retry ran again");
    // Opting in stores 5xx.
    let policy = Policy {
        store_server_errors: true,
        ..Policy::default()
    };
    let first = engine
        .execute(request("a", "stored5xx", "{}"), &policy, || async {
            handled(502)
        })
        .await;
    assert!(matches!(
        first,
        Outcome::Executed {
            recorded: Recorded::Stored,
            ..
        }
    ));
    let again = engine
        .execute(request("a", "stored5xx", "{}"), &policy, || async {
            handled(502)
        })
        .await;
    assert!(matches!(again, Outcome::Replayed(_)));
}

#[tokio::test]
async fn panic_releases_the_key_and_resumes() {
    let store = MemoryStore::new();
    let engine = Engine::new(store.clone());
    let task = {
        let engine = engine.clone();
        tokio::spawn(async move {
            engine
                .execute(request("a", "boom", "{}"), &Policy::default(), || async {
                    if true {
                        panic!("handler exploded");
                    }
                    handled(200)
                })
                .await
        })
    };
    let err = task.await.expect_err("the panic propagates");
    assert!(err.is_panic());
    assert_eq!(
        store.get(&record_key("a", "boom")).await.unwrap(),
        None,
        "key released"
    );
    let out = engine
        .execute(request("a", "boom", "{}"), &Policy::default(), || async {
            handled(201)
        })
        .await;
    assert!(matches!(out, Outcome::Executed { value: 201, .. }));
}

/// A caller that stops waiting for `execute` (its future dropped mid-handler) must not free
/// the key: the handler may already have done its work, so a retry gets "in progress" until
/// the lease ends, never a second execution. (Before the fix the drop released the key and the
/// retry ran the handler again.)
#[tokio::test]
async fn cancellation_leaves_the_record_in_progress_until_the_lease_ends() {
    let clock = Arc::new(ManualClock::new());
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let engine = Engine::new(store.clone());
    let policy = Policy {
        lease: Duration::from_secs(10),
        ..Policy::default()
    };
    let started = Arc::new(tokio::sync::Notify::new());
    let task = {
        let (engine, started) = (engine.clone(), started.clone());
        tokio::spawn(async move {
            engine
                .execute(request("a", "cancel", "{}"), &policy, || async move {
                    started.notify_one();
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                    handled(201)
                })
                .await
        })
    };
    started.notified().await;
    task.abort(); // the caller went away: the handler future is dropped
    let _ = task.await;
    let calls = AtomicUsize::new(0);
    for _ in 0..3 {
        tokio::task::yield_now().await;
        let out = engine
            .execute(request("a", "cancel", "{}"), &policy, || async {
                calls.fetch_add(1, Ordering::SeqCst);
                handled(201)
            })
            .await;
        assert!(matches!(out, Outcome::InProgress { .. }), "{out:?}");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    assert_eq!(
        engine.running(),
        0,
        "the dropped execution is not counted as running"
    );
    // After the lease a retry takes over (the documented limit of plain mode).
    clock.advance(Duration::from_secs(11));
    let out = engine
        .execute(request("a", "cancel", "{}"), &policy, || async {
            handled(201)
        })
        .await;
    assert!(matches!(out, Outcome::Executed { .. }), "{out:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeat_keeps_a_slow_handlers_lease() {
    let store = MemoryStore::new();
    let engine = Engine::new(store.clone());
    let policy = Policy {
        lease: Duration::from_millis(200),
        ..Policy::default()
    };
    let slow = {
        let engine = engine.clone();
        tokio::spawn(async move {
            engine
                .execute(request("a", "slow", "{}"), &policy, || async {
                    tokio::time::sleep(Duration::from_millis(900)).await;
                    handled(201)
                })
                .await
        })
    };
    // Well past the 200 ms lease, a retry still finds the attempt in progress, not taken over.
    let calls = AtomicUsize::new(0);
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_millis(120)).await;
        let out = engine
            .execute(request("a", "slow", "{}"), &policy, || async {
                calls.fetch_add(1, Ordering::SeqCst);
                handled(201)
            })
            .await;
        assert!(matches!(out, Outcome::InProgress { .. }), "{out:?}");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    let first = slow.await.unwrap();
    assert!(
        matches!(
            first,
            Outcome::Executed {
                recorded: Recorded::Stored,
                ..
            }
        ),
        "{first:?}"
    );
}

#[tokio::test]
async fn without_heartbeat_a_lost_lease_is_reported() {
    // A store clock far ahead after the claim makes the lease run out; a second attempt takes
    // over, and the first attempt's completion is refused as stale rather than overwriting.
    let clock = Arc::new(ManualClock::new());
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let engine = Engine::new(store.clone());
    let policy = Policy {
        lease: Duration::from_secs(3600),
        ..Policy::default()
    };
    let out = engine
        .execute(request("a", "lost", "{}"), &policy, || async {
            clock.advance(Duration::from_secs(7200));
            let inner = engine
                .execute(request("a", "lost", "{}"), &policy, || async {
                    handled(201)
                })
                .await;
            assert!(
                matches!(
                    inner,
                    Outcome::Executed {
                        recorded: Recorded::Stored,
                        ..
                    }
                ),
                "{inner:?}"
            );
            handled(200)
        })
        .await;
    assert!(
        matches!(
            out,
            Outcome::Executed {
                recorded: Recorded::Failed(StoreError::StaleLease),
                ..
            }
        ),
        "{out:?}"
    );
    match engine
        .execute(request("a", "lost", "{}"), &policy, || async {
            handled(200)
        })
        .await
    {
        Outcome::Replayed(o) => assert_eq!(o.status(), 201, "the takeover's result stands"),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn keys_mismatch_and_optional() {
    let engine = Engine::new(MemoryStore::new());
    let p = Policy::default();
    let _ = engine
        .execute(request("a", "k", r#"{"x":1}"#), &p, || async {
            handled(201)
        })
        .await;
    // Same JSON, keys reordered and spaced: replay.
    let same = engine
        .execute(request("a", "k", r#"{ "x" : 1 }"#), &p, || async {
            handled(201)
        })
        .await;
    assert!(matches!(same, Outcome::Replayed(_)));
    let other = engine
        .execute(request("a", "k", r#"{"x":2}"#), &p, || async {
            handled(201)
        })
        .await;
    assert!(matches!(other, Outcome::Mismatch { in_progress: false }));
    // Another caller with the same key runs its own handler.
    let b = engine
        .execute(request("b", "k", r#"{"x":2}"#), &p, || async {
            handled(201)
        })
        .await;
    assert!(matches!(b, Outcome::Executed { .. }));
    let mut missing = request("a", "k", "{}");
    missing.key = Err(KeyError::Missing);
    let out = engine
        .execute(missing.clone(), &p, || async { handled(201) })
        .await;
    assert!(matches!(out, Outcome::KeyRejected(KeyError::Missing)));
    let optional = Policy {
        key: KeyRequirement::Optional,
        ..p
    };
    let out = engine
        .execute(missing, &optional, || async { handled(201) })
        .await;
    assert!(matches!(out, Outcome::NoKey(201)));
    let bad = request("a", "", "{}");
    let out = engine
        .execute(bad, &optional, || async { handled(201) })
        .await;
    assert!(
        matches!(out, Outcome::KeyRejected(KeyError::Empty)),
        "a malformed key is never optional"
    );
}

#[tokio::test]
async fn store_failure_refuses_unless_fail_open() {
    let store = MemoryStore::builder().max_entries(0).build();
    let engine = Engine::new(store);
    let calls = AtomicUsize::new(0);
    let out = engine
        .execute(request("a", "k", "{}"), &Policy::default(), || async {
            calls.fetch_add(1, Ordering::SeqCst);
            handled(201)
        })
        .await;
    assert!(matches!(
        out,
        Outcome::StoreUnavailable(StoreError::Capacity { .. })
    ));
    assert_eq!(
        calls.load(Ordering::SeqCst),
        0,
        "never run unprotected by default"
    );
    let open = Policy {
        fail_open: true,
        ..Policy::default()
    };
    let out = engine
        .execute(request("a", "k", "{}"), &open, || async { handled(201) })
        .await;
    assert!(matches!(out, Outcome::FailedOpen { value: 201, .. }));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_executes_run_once() {
    let engine = Engine::new(MemoryStore::new());
    let calls = Arc::new(AtomicUsize::new(0));
    let barrier = Arc::new(tokio::sync::Barrier::new(32));
    let tasks: Vec<_> = (0..32)
        .map(|_| {
            let (engine, calls, barrier) = (engine.clone(), calls.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                engine
                    .execute(request("a", "race", "{}"), &Policy::default(), || async {
                        calls.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        handled(201)
                    })
                    .await
            })
        })
        .collect();
    let mut executed = 0;
    for t in tasks {
        match t.await.unwrap() {
            Outcome::Executed { .. } => executed += 1,
            Outcome::InProgress { .. } | Outcome::Replayed(_) => {}
            other => panic!("{other:?}"),
        }
    }
    assert_eq!((executed, calls.load(Ordering::SeqCst)), (1, 1));
}

#[tokio::test]
async fn sweeper_purges_and_stops() {
    let clock = Arc::new(ManualClock::new());
    let store = Arc::new(MemoryStore::builder().clock(clock.clone()).build());
    let engine = Engine::from_arc(store.clone());
    let policy = Policy {
        ttl: Duration::from_secs(1),
        lease: Duration::from_secs(1),
        ..Policy::default()
    };
    for i in 0..50 {
        let _ = engine
            .execute(request("a", &format!("k{i}"), "{}"), &policy, || async {
                handled(201)
            })
            .await;
    }
    assert_eq!(store.len(), 50);
    clock.advance(Duration::from_secs(5));
    let sweeper = Sweeper::spawn(store.clone(), Duration::from_millis(10), 7);
    for _ in 0..200 {
        if store.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(store.is_empty());
    sweeper.shutdown().await;
}

/// A memory store whose claims answer late (a slow network between the applied claim and its
/// answer) or fail as corrupt, and which records when each lease extension arrives.
struct Wrapped {
    inner: MemoryStore,
    claim_delay: Duration,
    corrupt_claims: bool,
    extends: std::sync::Mutex<Vec<tokio::time::Instant>>,
}

impl Wrapped {
    fn new() -> Self {
        Wrapped {
            inner: MemoryStore::new(),
            claim_delay: Duration::ZERO,
            corrupt_claims: false,
            extends: std::sync::Mutex::default(),
        }
    }
}

#[async_trait::async_trait]
impl Store for Wrapped {
    async fn claim(&self, req: ClaimRequest<'_>) -> Result<ClaimOutcome, StoreError> {
        if self.corrupt_claims {
            return Err(StoreError::Corrupt("unreadable stored response".into()));
        }
        let outcome = self.inner.claim(req).await;
        tokio::time::sleep(self.claim_delay).await;
        outcome
    }
    async fn complete(
        &self,
        key: &RecordKey,
        token: LeaseToken,
        outcome: &StoredOutcome,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        self.inner.complete(key, token, outcome, ttl).await
    }
    async fn release(&self, key: &RecordKey, token: LeaseToken) -> Result<(), StoreError> {
        self.inner.release(key, token).await
    }
    async fn extend(
        &self,
        key: &RecordKey,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<std::time::SystemTime, StoreError> {
        self.extends
            .lock()
            .unwrap()
            .push(tokio::time::Instant::now());
        self.inner.extend(key, token, lease).await
    }
    async fn purge_expired(&self, batch: usize) -> Result<u64, StoreError> {
        self.inner.purge_expired(batch).await
    }
    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        self.inner.get(key).await
    }
    async fn delete(&self, key: &RecordKey, force: bool) -> Result<Deleted, StoreError> {
        self.inner.delete(key, force).await
    }
}

/// The store's lease starts somewhere during the claim's round trip, so the heartbeat's
/// half-lease margin must count from the moment the claim was sent: counted from the answer,
/// a claim whose answer took most of half a lease leaves the first extension until nearly the
/// end of the lease the store started.
#[tokio::test(start_paused = true)]
async fn the_heartbeat_margin_counts_from_before_the_claim() {
    let lease = Duration::from_secs(10);
    let store = Arc::new(Wrapped {
        claim_delay: Duration::from_secs(4),
        ..Wrapped::new()
    });
    let engine = Engine::from_arc(store.clone());
    let policy = Policy {
        lease,
        ..Policy::default()
    };
    let sent = tokio::time::Instant::now();
    let Begin::Claimed(mut execution) =
        engine.begin(request("a", "hb-margin", "{}"), &policy).await
    else {
        panic!("not claimed")
    };
    assert_eq!(
        sent.elapsed(),
        Duration::from_secs(4),
        "the claim's round trip"
    );
    let _ = tokio::time::timeout(lease, execution.run(std::future::pending::<()>())).await;
    let first = store.extends.lock().unwrap().first().copied();
    let first = first.expect("the heartbeat extended the lease");
    assert!(
        first - sent <= lease / 2,
        "first extension {:?} after the claim was sent, later than half the lease ({:?})",
        first - sent,
        lease / 2
    );
    assert!(matches!(execution.release().await, Recorded::Released));
}

/// Fail-open runs a handler unprotected when the store cannot answer; a record the store
/// cannot decode is an answer (a record exists and may hold a finished outcome), so the
/// request is refused like any failing store's, and the handler never runs.
#[tokio::test]
async fn fail_open_never_runs_a_handler_whose_record_is_corrupt() {
    let engine = Engine::new(Wrapped {
        corrupt_claims: true,
        ..Wrapped::new()
    });
    let calls = AtomicUsize::new(0);
    let open = Policy {
        fail_open: true,
        ..Policy::default()
    };
    let out = engine
        .execute(request("a", "corrupt", "{}"), &open, || async {
            calls.fetch_add(1, Ordering::SeqCst);
            handled(201)
        })
        .await;
    assert!(
        matches!(out, Outcome::StoreUnavailable(StoreError::Corrupt(_))),
        "{out:?}"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 0, "the handler ran");
}

/// A handler panic under a [`Detached`] execution (how the adapters run one) is reported once:
/// the detached future that unwound must not be spawned again when it is dropped, where it
/// would panic a second time ("`async fn` resumed after panicking").
#[test]
fn a_handler_panic_is_reported_once() {
    const THREAD: &str = "a-handler-panic-is-reported-once";
    let panics = Arc::new(AtomicUsize::new(0));
    let previous = std::panic::take_hook();
    {
        let panics = Arc::clone(&panics);
        std::panic::set_hook(Box::new(move |info| {
            if std::thread::current().name() == Some(THREAD) {
                panics.fetch_add(1, Ordering::SeqCst);
            }
            previous(info);
        }));
    }
    let store = MemoryStore::new();
    let engine = Engine::new(store.clone());
    std::thread::Builder::new()
        .name(THREAD.into())
        .spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let task = tokio::spawn(Detached::new(async move {
                    let begin = engine
                        .begin(request("a", "detached-boom", "{}"), &Policy::default())
                        .await;
                    let Begin::Claimed(mut execution) = begin else {
                        unreachable!("not claimed: {begin:?}")
                    };
                    let ran = execution
                        .run(async {
                            if true {
                                panic!("handler exploded");
                            }
                            handled(200)
                        })
                        .await;
                    match ran {
                        Ok(handled) => execution.finish(handled.record).await,
                        Err(panic) => {
                            execution.release().await;
                            std::panic::resume_unwind(panic)
                        }
                    }
                }));
                assert!(task.await.unwrap_err().is_panic());
                // Whatever the unwind left to run gets its turn.
                tokio::time::sleep(Duration::from_millis(50)).await;
            });
        })
        .unwrap()
        .join()
        .unwrap();
    assert_eq!(panics.load(Ordering::SeqCst), 1, "panics reported");
    let left = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
        .block_on(store.get(&record_key("a", "detached-boom")))
        .unwrap();
    assert_eq!(left, None, "key released");
}
