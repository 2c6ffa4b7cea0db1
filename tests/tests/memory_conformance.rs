//! The store conformance suite on the in-memory store.
#![allow(clippy::unwrap_used)] // tests unwrap freely

use idempotent_core::{ManualClock, MemoryStore, Store};
use idempotent_tests::{Fixture, conformance_suite};
use std::sync::Arc;
use std::time::Duration;

struct Memory {
    clock: Arc<ManualClock>,
}

fn memory() -> Memory {
    Memory {
        clock: Arc::new(ManualClock::new()),
    }
}

#[async_trait::async_trait]
impl Fixture for Memory {
    async fn fresh(&self) -> Arc<dyn Store> {
        Arc::new(MemoryStore::builder().clock(self.clock.clone()).build())
    }
    async fn advance(&self, by: Duration) {
        self.clock.advance(by);
    }
}

conformance_suite!(memory_store, crate::memory());

#[tokio::test]
async fn capacity_is_enforced_and_expired_records_make_room() {
    use idempotent_core::*;
    let clock = Arc::new(ManualClock::new());
    let store = MemoryStore::builder()
        .max_entries(3)
        .clock(clock.clone())
        .build();
    let fp = idempotent_tests::conformance::fp("a");
    let short = Duration::from_secs(10);
    let mut keys = Vec::new();
    for i in 0..3 {
        let key = idempotent_tests::conformance::unique_key(&format!("c{i}"));
        let out = store
            .claim(ClaimRequest {
                key: &key,
                fingerprint: &fp,
                lease: short,
                ttl: short,
            })
            .await
            .unwrap();
        assert!(matches!(out, ClaimOutcome::Claimed(_)));
        keys.push(key);
    }
    let extra = idempotent_tests::conformance::unique_key("c3");
    let req = ClaimRequest {
        key: &extra,
        fingerprint: &fp,
        lease: short,
        ttl: short,
    };
    assert!(matches!(
        store.claim(req).await,
        Err(StoreError::Capacity { max_entries: 3 })
    ));
    // Existing records still answer while full.
    let again = ClaimRequest {
        key: &keys[0],
        fingerprint: &fp,
        lease: short,
        ttl: short,
    };
    assert!(matches!(
        store.claim(again).await,
        Ok(ClaimOutcome::InProgress { .. })
    ));
    clock.advance(short * 2);
    assert!(matches!(
        store.claim(req).await,
        Ok(ClaimOutcome::Claimed(_))
    ));
    assert_eq!(store.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn capacity_holds_under_concurrent_claims() {
    use idempotent_core::*;
    let store = Arc::new(MemoryStore::builder().max_entries(10).build());
    let fp = idempotent_tests::conformance::fp("a");
    let barrier = Arc::new(tokio::sync::Barrier::new(64));
    let tasks: Vec<_> = (0..64)
        .map(|i| {
            let (store, barrier) = (store.clone(), barrier.clone());
            tokio::spawn(async move {
                let key = idempotent_tests::conformance::unique_key(&format!("cap{i}"));
                barrier.wait().await;
                let req = ClaimRequest {
                    key: &key,
                    fingerprint: &fp,
                    lease: Duration::from_secs(60),
                    ttl: Duration::from_secs(60),
                };
                store.claim(req).await
            })
        })
        .collect();
    let mut claimed = 0;
    for t in tasks {
        match t.await.unwrap() {
            Ok(ClaimOutcome::Claimed(_)) => claimed += 1,
            Err(StoreError::Capacity { max_entries: 10 }) => {}
            other => panic!("{other:?}"),
        }
    }
    assert_eq!((claimed, store.len()), (10, 10));
}

/// One caller sending fresh keys fills its own share and no more: its next claim is refused
/// with `ScopeCapacity` while another caller's claim goes on; its expired records make room
/// again; a released record frees its slot; the unscoped namespace has no per-scope bound.
#[tokio::test]
async fn one_scope_cannot_fill_the_store_for_everyone() {
    use idempotent_core::*;
    let clock = Arc::new(ManualClock::new());
    let store = MemoryStore::builder()
        .max_entries(100)
        .max_per_scope(3)
        .clock(clock.clone())
        .build();
    let fp = idempotent_tests::conformance::fp("a");
    let short = Duration::from_secs(10);
    let key = |scope: &Scope, k: &str| RecordKey::new(scope.clone(), k.parse().unwrap());
    let claim = |k: RecordKey| {
        let store = store.clone();
        async move {
            store
                .claim(ClaimRequest {
                    key: &k,
                    fingerprint: &fp,
                    lease: short,
                    ttl: short,
                })
                .await
        }
    };
    let greedy = Scope::new("greedy").unwrap();
    let mut tokens = Vec::new();
    for i in 0..3 {
        match claim(key(&greedy, &format!("k{i}"))).await.unwrap() {
            ClaimOutcome::Claimed(lease) => tokens.push(lease.token),
            other => panic!("{other:?}"),
        }
    }
    assert!(matches!(
        claim(key(&greedy, "k3")).await,
        Err(StoreError::ScopeCapacity { max_per_scope: 3 })
    ));
    // Its own records still answer, and another caller is not held up.
    assert!(matches!(
        claim(key(&greedy, "k0")).await,
        Ok(ClaimOutcome::InProgress { .. })
    ));
    let other = Scope::new("other").unwrap();
    assert!(matches!(
        claim(key(&other, "k0")).await,
        Ok(ClaimOutcome::Claimed(_))
    ));
    // A release frees its slot.
    store.release(&key(&greedy, "k0"), tokens[0]).await.unwrap();
    assert!(matches!(
        claim(key(&greedy, "k3")).await,
        Ok(ClaimOutcome::Claimed(_))
    ));
    assert!(matches!(
        claim(key(&greedy, "k4")).await,
        Err(StoreError::ScopeCapacity { .. })
    ));
    // Expired records are purged to make room.
    clock.advance(short * 3);
    for i in 5..8 {
        assert!(matches!(
            claim(key(&greedy, &format!("k{i}"))).await,
            Ok(ClaimOutcome::Claimed(_))
        ));
    }
    assert_eq!(store.len(), 3, "the expired records were purged");
    // The unscoped namespaces are everyone's: only max_entries bounds them (unscoped routes,
    // and unscoped functions: a consumer deduplicating by message id); a function's records
    // for one caller are that caller's.
    let unscoped_call = Scope::new("call:4:book:").unwrap();
    for i in 0..10 {
        for scope in [&Scope::unscoped(), &unscoped_call] {
            assert!(matches!(
                claim(key(scope, &format!("u{i}"))).await,
                Ok(ClaimOutcome::Claimed(_))
            ));
        }
    }
    let tenant_call = Scope::new("call:4:book:acme").unwrap();
    for i in 0..3 {
        assert!(matches!(
            claim(key(&tenant_call, &format!("t{i}"))).await,
            Ok(ClaimOutcome::Claimed(_))
        ));
    }
    assert!(matches!(
        claim(key(&tenant_call, "t3")).await,
        Err(StoreError::ScopeCapacity { .. })
    ));
}
