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
/// on time even though nobody polls the stream (a client that stopped reading) and extending
/// takes a while, so no retry can take the record over mid-stream.
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
    let recorder = Recorder::streaming(execution, Capture::new(200, [], 1024));
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let retry = engine.begin(request("stream"), &policy).await;
        assert!(
            matches!(retry, Begin::InProgress { .. }),
            "taken over mid-stream: {retry:?}"
        );
    }
    assert!(matches!(recorder.end().await, Recorded::Stored));
}

/// The lease is renewed while the outcome's write is on its way, as while the handler runs: a
/// completion that takes three leases to reach the store (a connection that hangs while
/// extensions still answer) must not let a retry take the record over and run the handler a
/// second time; the completion then lands and retries replay it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_completion_keeps_its_lease() {
    let store = FaultyStore::new(MemoryStore::new());
    store.delay_completes(Duration::from_millis(900));
    let engine = Engine::from_arc(store.clone());
    let policy = Policy {
        lease: Duration::from_millis(300),
        ..Policy::default()
    };
    let Begin::Claimed(execution) = engine.begin(request("slow-complete"), &policy).await else {
        panic!("not claimed")
    };
    let finishing = tokio::spawn(execution.finish(StoredResponse::new(201, "ok").into()));
    for round in 0..7 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let retry = engine.begin(request("slow-complete"), &policy).await;
        assert!(
            matches!(retry, Begin::InProgress { .. }),
            "a retry {} ms after the completion was sent found {retry:?}: the lease ran out while the completion was on its way",
            (round + 1) * 100
        );
    }
    assert!(matches!(finishing.await.unwrap(), Recorded::Stored));
    assert_eq!(store.completes(), 1);
    let replay = engine.begin(request("slow-complete"), &policy).await;
    assert!(
        matches!(&replay, Begin::Replay(StoredOutcome::Response(r)) if r.status == 201),
        "{replay:?}"
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
