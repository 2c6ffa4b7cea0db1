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
