//! The engine's life cycle with a real store and real time: leases kept while a response
//! streams, drain against requests that are mid-claim, and policies out of bounds.
#![allow(clippy::unwrap_used)] // tests unwrap freely

use idempotent_core::__private::{Capture, Recorder};
use idempotent_core::{engine::*, store::*, *};
use idempotent_tests::execute::{Execute, Handled, Outcome};
use idempotent_tests::faults::FaultyStore;
use std::time::Duration;

fn request(key: &str) -> ExecuteRequest {
    ExecuteRequest {
        scope: Scope::new("acct").unwrap(),
        key: IdempotencyKey::parse(key.as_bytes()),
        fingerprint: idempotent_tests::conformance::fp(key),
    }
}

/// A handler that returns a stream just before half its lease: the lease must be extended
/// on time by the heartbeat task, not by polls of the stream (a slow client reads a chunk
/// now and then), even though extending takes a while, so no retry can take the record over
/// mid-stream. (A stream that moves nothing for a whole lease is stored as not replayable:
/// `a_client_that_stops_reading_never_holds_its_key` in the HTTP contract.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_response_keeps_its_lease_on_time() {
    let store = FaultyStore::new(MemoryStore::new());
    store.delay_extends(Duration::from_millis(60));
    let engine = Engine::from_arc(store.clone());
    let policy = Policy {
        lease: Duration::from_millis(300),
        ..Policy::default()
    };
    let Begin::Claimed(mut execution) = engine.begin(request("stream"), &policy).await else {
        panic!("not claimed")
    };
    // The handler takes just under half the lease, then hands back a stream.
    execution
        .run(tokio::time::sleep(Duration::from_millis(140)))
        .await
        .unwrap();
    let mut recorder = Recorder::streaming(execution, Capture::new(200, [], 1024));
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(recorder.data(b"a chunk;"));
        let retry = engine.begin(request("stream"), &policy).await;
        assert!(
            matches!(retry, Begin::InProgress { .. }),
            "taken over mid-stream: {retry:?}"
        );
    }
    assert!(matches!(recorder.end().await, Recorded::Stored));
}

/// The lease is renewed while the outcome's write is on its way, as while the handler ran: a
/// completion or a release that takes three leases to reach the store (a connection that
/// hangs while extensions still answer) must not let a retry take the record over and run
/// the handler a second time. Once the write lands the renewals stop.
async fn a_slow_write_keeps_its_lease(store_it: bool) {
    let lease = Duration::from_secs(1);
    let store = FaultyStore::new(MemoryStore::new());
    store.delay_finishes(lease * 3);
    let engine = Engine::from_arc(store.clone());
    let policy = Policy {
        lease,
        ..Policy::default()
    };
    let key = if store_it {
        "slow-complete"
    } else {
        "slow-release"
    };
    let Begin::Claimed(execution) = engine.begin(request(key), &policy).await else {
        panic!("not claimed")
    };
    let sent = std::time::Instant::now();
    let finishing = tokio::spawn(async move {
        if store_it {
            execution
                .finish(StoredResponse::new(201, "ok").into())
                .await
        } else {
            execution.release().await
        }
    });
    let mut in_progress = 0;
    while !finishing.is_finished() {
        tokio::time::sleep(Duration::from_millis(100)).await;
        match engine.begin(request(key), &policy).await {
            Begin::InProgress { .. } => in_progress += 1,
            // The write landed (`finishing` is about to end): a replay, or a new claim after
            // the release, which this test lets go.
            Begin::Replay(_) if store_it => break,
            Begin::Claimed(retry) if !store_it && sent.elapsed() >= lease * 3 => {
                drop(retry.release().await);
                break;
            }
            found => panic!(
                "a retry {} ms after the write was sent found {found:?}: the lease ran out while the write was on its way",
                sent.elapsed().as_millis()
            ),
        }
    }
    let recorded = finishing.await.unwrap();
    assert!(
        matches!(
            (&recorded, store_it),
            (Recorded::Stored, true) | (Recorded::Released, false)
        ),
        "{recorded:?}"
    );
    assert!(
        in_progress >= 10,
        "only {in_progress} retries while the write was on its way"
    );
    assert!(
        store.extends() >= 3,
        "the lease was not renewed: {} extensions",
        store.extends()
    );
    // The renewals stopped with the write.
    let extends = store.extends();
    tokio::time::sleep(lease * 2).await;
    assert_eq!(
        store.extends(),
        extends,
        "the heartbeat outlived its execution"
    );
    if store_it {
        let replay = engine.begin(request(key), &policy).await;
        assert!(
            matches!(&replay, Begin::Replay(StoredOutcome::Response(r)) if r.status == 201),
            "{replay:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_completion_keeps_its_lease() {
    a_slow_write_keeps_its_lease(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_release_keeps_its_lease() {
    a_slow_write_keeps_its_lease(false).await;
}

/// A write that never answers (a connection that went silent) is given up after its bound
/// (a lease, at least 10 s), retried once within the lease, then reported; the heartbeat that
/// kept the lease while it waited stops, so the lease ends and a retry can run. Paused time:
/// the bound passes in virtual time.
#[tokio::test(start_paused = true)]
async fn a_write_that_never_answers_is_given_up() {
    let store = FaultyStore::new(MemoryStore::new());
    store.delay_finishes(Duration::from_secs(24 * 3600));
    let engine = Engine::from_arc(store.clone());
    let policy = Policy {
        lease: Duration::from_secs(2),
        ..Policy::default()
    };
    let Begin::Claimed(execution) = engine.begin(request("silent"), &policy).await else {
        panic!("not claimed")
    };
    let sent = tokio::time::Instant::now();
    let recorded = execution
        .finish(StoredResponse::new(201, "ok").into())
        .await;
    assert!(
        matches!(recorded, Recorded::Failed(StoreError::Unavailable(_))),
        "{recorded:?}"
    );
    let waited = sent.elapsed();
    assert!(
        (Duration::from_secs(10)..Duration::from_secs(30)).contains(&waited),
        "gave up after {waited:?}"
    );
    assert_eq!(store.completes(), 2, "one attempt and one retry");
    assert!(
        store.extends() >= 8,
        "the lease was kept while the write waited"
    );
    let extends = store.extends();
    tokio::time::sleep(policy.lease * 3).await;
    assert_eq!(
        store.extends(),
        extends,
        "the heartbeat outlived its execution"
    );
}

/// A drain that starts while a request's claim is on its way waits for that execution.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_waits_for_a_request_that_is_mid_claim() {
    let store = FaultyStore::new(MemoryStore::new());
    store.delay_claims(Duration::from_millis(200));
    let engine = Engine::from_arc(store.clone());
    let work = {
        let engine = engine.clone();
        tokio::spawn(async move {
            engine
                .execute(request("mid"), &Policy::default(), || async {
                    Handled {
                        value: (),
                        record: StoredResponse::new(201, "ok").into(),
                    }
                })
                .await
        })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(store.claims(), 1, "the claim is in flight");
    let drained = engine.drain(Duration::from_secs(5)).await;
    assert_eq!(drained.still_running, 0);
    // The execution counts until its response is stored (its task may still be returning on
    // another thread, so the store is what to look at, not the task).
    let req = request("mid");
    let record = store
        .get(&RecordKey::new(req.scope, req.key.expect("a valid key")))
        .await
        .expect("store answers")
        .expect("the record exists");
    assert!(
        matches!(record.state, RecordState::Done { .. }),
        "drain returned before the execution finished: {:?}",
        record.state
    );
    assert!(matches!(
        work.await.unwrap(),
        Outcome::Executed {
            recorded: Recorded::Stored,
            ..
        }
    ));
}

/// A policy out of bounds is refused by the engine itself (callers that build `Policy` by hand,
/// such as queue consumers), never run under a lease that cannot hold, and never a panic.
#[tokio::test]
async fn out_of_bounds_policies_are_refused_not_run() {
    let engine = Engine::new(MemoryStore::new());
    for (ttl, lease) in [
        (DEFAULT_TTL, Duration::ZERO),
        (DEFAULT_TTL, Duration::from_micros(500)),
        (Duration::MAX, Duration::MAX),
        (Duration::from_secs(1), Duration::from_secs(2)),
    ] {
        let policy = Policy {
            ttl,
            lease,
            ..Policy::default()
        };
        let out: Outcome<()> = engine
            .execute(request("bounds"), &policy, || async {
                panic!("must not run")
            })
            .await;
        assert!(
            matches!(out, Outcome::Misconfigured(_)),
            "{ttl:?}/{lease:?}: {out:?}"
        );
    }
    assert_eq!(engine.running(), 0);
}
