//! The store conformance suite on the in-memory store.
#![allow(clippy::unwrap_used)] // tests unwrap freely

use idempotent_core::{MemoryStore, Store, clock::ManualClock};
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
    use idempotent_core::{clock::*, store::*};
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
                max_stored: 0,
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
        max_stored: 0,
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
        max_stored: 0,
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
    use idempotent_core::store::*;
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
                    max_stored: 0,
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
    use idempotent_core::{clock::*, store::*, *};
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
                    max_stored: 0,
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
    // The unscoped namespace is everyone's: only max_entries bounds it (unscoped functions'
    // are too, see `function_scopes_are_shared_when_built_not_when_spelled_so`); a function's
    // records for one caller are that caller's.
    for i in 0..10 {
        assert!(matches!(
            claim(key(&Scope::unscoped(), &format!("u{i}"))).await,
            Ok(ClaimOutcome::Claimed(_))
        ));
    }
    let tenant_call = call::Call::record_scope("book", &Scope::new("acme").unwrap()).unwrap();
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

/// A scope is shared by every caller (no per-scope bound) because it was built so (the
/// unscoped constant, an unscoped idempotent function's namespace), never because its text
/// looks like one: no caller identity can read like a function's namespace (`call:` is
/// reserved), and a function's namespace for one caller is that caller's, bounded like any
/// other.
#[tokio::test]
async fn function_scopes_are_shared_when_built_not_when_spelled_so() {
    use idempotent_core::call::{Call, Calls};
    use idempotent_core::{engine::*, store::*, *};
    let store = MemoryStore::builder()
        .max_entries(100)
        .max_per_scope(3)
        .build();
    let fp = idempotent_tests::conformance::fp("a");
    let lease = Duration::from_secs(10);
    assert_eq!(Scope::new("call:1:x:"), Err(ScopeError::Reserved));
    let tenant_fn = Call::record_scope("x", &Scope::new("acme").unwrap()).unwrap();
    assert_eq!(tenant_fn.as_str(), "call:1:x:acme");
    let mut outcomes = Vec::new();
    for i in 0..4 {
        let key = RecordKey::new(tenant_fn.clone(), format!("k{i}").parse().unwrap());
        outcomes.push(
            store
                .claim(ClaimRequest {
                    key: &key,
                    fingerprint: &fp,
                    lease,
                    ttl: lease,
                    max_stored: 0,
                })
                .await,
        );
    }
    assert!(
        matches!(
            outcomes[3],
            Err(StoreError::ScopeCapacity { max_per_scope: 3 })
        ),
        "one tenant's function records skipped the per-scope bound: its 4th claim gave {:?}",
        outcomes[3]
    );
    // An unscoped idempotent function (a consumer deduplicating by message id) shares its
    // namespace with every caller: only max_entries bounds it.
    let calls = Calls::new(Engine::new(store.clone()));
    for i in 0..10_u32 {
        let id = format!("msg_{i}");
        let call = Call::new(
            "book",
            Scope::unscoped(),
            IdempotencyKey::parse(id.as_bytes()).unwrap(),
            &i,
        )
        .unwrap();
        let out = calls
            .run(call, || async move { Ok::<_, std::io::Error>(i) })
            .await;
        assert_eq!(out.unwrap(), i, "message {i}");
    }
}

/// Leases (and expiry) are measured on a monotonic clock: a wall clock stepped backwards (NTP,
/// an operator) does not extend a lease, one stepped forwards does not end it early nor expire
/// a finished record; only time passing does. A lease end reads the same before and after the
/// step (shown on the wall time the store started with plus monotonic time since).
#[tokio::test]
async fn leases_are_measured_on_a_monotonic_clock() {
    use idempotent_core::{clock::*, store::*};
    let clock = Arc::new(ManualClock::new());
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let fp = idempotent_tests::conformance::fp("a");
    let lease = Duration::from_secs(10);
    let ttl = Duration::from_secs(60);
    let hour = Duration::from_secs(3600);
    let k = idempotent_tests::conformance::unique_key("mono");
    let req = ClaimRequest {
        key: &k,
        fingerprint: &fp,
        lease,
        ttl,
        max_stored: 0,
    };
    let ClaimOutcome::Claimed(first) = store.claim(req).await.unwrap() else {
        panic!("not claimed");
    };
    let claimed_at = clock.now();
    // The wall clock steps back an hour: the lease still ends within 10 s.
    clock.set_wall_time(clock.now() - hour);
    match store.claim(req).await.unwrap() {
        ClaimOutcome::InProgress { retry_after } => assert!(
            retry_after <= lease,
            "a wall clock stepped back an hour extended the lease: retry after {retry_after:?}"
        ),
        other => panic!("{other:?}"),
    }
    let shown = store.get(&k).await.unwrap().expect("record");
    let RecordState::InProgress { locked_until, .. } = shown.state else {
        panic!("{shown:?}");
    };
    assert_eq!(
        locked_until, first.locked_until,
        "the lease end reads as the claim reported it, whatever the wall clock did"
    );
    let left = locked_until.duration_since(claimed_at);
    assert!(
        left.as_ref().is_ok_and(|left| *left <= lease),
        "the lease end is a lease after the claim: {left:?}"
    );
    // The wall clock steps forward two hours: the lease has not run out.
    clock.set_wall_time(clock.now() + 2 * hour);
    assert!(
        matches!(
            store.claim(req).await.unwrap(),
            ClaimOutcome::InProgress { .. }
        ),
        "a wall clock stepped forward ended the lease early"
    );
    // Nor does a finished record expire when the wall clock jumps past its ttl.
    store
        .complete(
            &k,
            first.token,
            &StoredResponse::new(201, "done").into(),
            ttl,
        )
        .await
        .unwrap();
    clock.set_wall_time(clock.now() + 24 * hour);
    assert!(
        matches!(store.claim(req).await.unwrap(), ClaimOutcome::Replay(_)),
        "a wall clock stepped forward expired a finished record"
    );
    // Time passing does end a lease.
    let k2 = idempotent_tests::conformance::unique_key("mono2");
    let req2 = ClaimRequest { key: &k2, ..req };
    assert!(matches!(
        store.claim(req2).await.unwrap(),
        ClaimOutcome::Claimed(_)
    ));
    clock.advance(lease + Duration::from_secs(1));
    match store.claim(req2).await.unwrap() {
        ClaimOutcome::Claimed(lease) => assert!(lease.took_over),
        other => panic!("{other:?}"),
    }
}

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;

/// The route limit the byte-budget tests' claims reserve (their responses are 200 KiB).
const LIMIT: u64 = 256 * KIB;

/// Claims `k` reserving [`LIMIT`] and, if claimed, completes it with a body of `size`.
async fn claim_and_store(
    store: &idempotent_core::MemoryStore,
    k: &idempotent_core::store::RecordKey,
    size: u64,
) -> Result<idempotent_core::store::ClaimOutcome, idempotent_core::StoreError> {
    claim_and_store_within(store, k, size, LIMIT).await
}

/// Claims `k` reserving `limit` (the route's `max_response`) and, if claimed, completes it
/// with a body of `size`.
async fn claim_and_store_within(
    store: &idempotent_core::MemoryStore,
    k: &idempotent_core::store::RecordKey,
    size: u64,
    limit: u64,
) -> Result<idempotent_core::store::ClaimOutcome, idempotent_core::StoreError> {
    use idempotent_core::store::*;
    let fp = idempotent_tests::conformance::fp("a");
    let short = Duration::from_secs(10);
    let out = store
        .claim(ClaimRequest {
            key: k,
            fingerprint: &fp,
            lease: short,
            ttl: short,
            max_stored: limit,
        })
        .await?;
    if let ClaimOutcome::Claimed(lease) = &out {
        let body = vec![b'x'; usize::try_from(size).unwrap()];
        let response = StoredResponse::new(201, body).with_header("content-type", "text/plain");
        store
            .complete(k, lease.token, &response.into(), short)
            .await
            .unwrap();
    }
    Ok(out)
}

/// What a replay of `k` gives: the stored body's length, or `None` for the "not stored"
/// marker.
async fn replayed_size(
    store: &idempotent_core::MemoryStore,
    k: &idempotent_core::store::RecordKey,
) -> Option<usize> {
    use idempotent_core::store::*;
    let fp = idempotent_tests::conformance::fp("a");
    let short = Duration::from_secs(10);
    match store
        .claim(ClaimRequest {
            key: k,
            fingerprint: &fp,
            lease: short,
            ttl: short,
            max_stored: 0,
        })
        .await
        .unwrap()
    {
        ClaimOutcome::Replay(StoredOutcome::Response(r)) => Some(r.body.len()),
        ClaimOutcome::Replay(StoredOutcome::Oversized { status: 201, .. }) => None,
        other => panic!("{other:?}"),
    }
}

/// One caller storing large responses fills its own byte budget and no more: each claim
/// reserves the route's limit when it is admitted, so the claim that would let the scope's
/// records store past the budget is refused with `ScopeByteCapacity` (answered as the count
/// bound is), and every admitted claim's response is stored and replayed (never the "not
/// stored" marker), while another caller goes on. Deleted, released and expired records give
/// their bytes back.
#[tokio::test]
async fn one_scope_cannot_fill_the_store_with_bytes() {
    use idempotent_core::{clock::*, engine::*, store::*, *};
    let clock = Arc::new(ManualClock::new());
    let store = MemoryStore::builder()
        .max_bytes(64 * MIB)
        .max_bytes_per_scope(MIB)
        .clock(clock.clone())
        .build();
    let greedy = Scope::new("greedy").unwrap();
    let key = |scope: &Scope, k: &str| RecordKey::new(scope.clone(), k.parse().unwrap());
    let mut refused = None;
    for i in 0..20 {
        match claim_and_store(&store, &key(&greedy, &format!("k{i}")), 200 * KIB).await {
            Ok(ClaimOutcome::Claimed(_)) => {}
            Ok(other) => panic!("{other:?}"),
            Err(e) => {
                refused = Some((i, e));
                break;
            }
        }
    }
    let Some((at, error)) = refused else {
        panic!("one caller stored 20 responses of 200 KiB (4 MiB) under a 1 MiB budget");
    };
    assert!(
        matches!(
            error,
            StoreError::ScopeByteCapacity {
                max_bytes_per_scope: MIB
            }
        ),
        "{error:?}"
    );
    // Four 200 KiB responses are stored; the fifth claim would reserve 256 KiB more, past the
    // budget: refused. The scope never holds more than its budget.
    assert_eq!(at, 4, "refused at claim {at}");
    for i in 0..4 {
        assert_eq!(
            replayed_size(&store, &key(&greedy, &format!("k{i}"))).await,
            Some(200 * 1024),
            "k{i}"
        );
    }
    assert!(
        store.bytes() > 4 * 200 * KIB && store.bytes() <= MIB,
        "{}",
        store.bytes()
    );
    // Another caller is not held up.
    let other = Scope::new("other").unwrap();
    assert!(matches!(
        claim_and_store(&store, &key(&other, "k0"), 200 * KIB).await,
        Ok(ClaimOutcome::Claimed(_))
    ));
    assert_eq!(
        replayed_size(&store, &key(&other, "k0")).await,
        Some(200 * 1024)
    );
    // Through the engine the refusal is the count bound's answer (HTTP: 503, `Retry-After`,
    // `idempotency-store-unavailable`): the handler does not run.
    let engine = Engine::new(store.clone());
    let request = ExecuteRequest {
        scope: greedy.clone(),
        key: "k20".parse(),
        fingerprint: idempotent_tests::conformance::fp("a"),
    };
    let out = engine.begin(request, &Policy::default()).await;
    assert!(
        matches!(
            out,
            Begin::StoreUnavailable(StoreError::ScopeByteCapacity { .. })
        ),
        "{out:?}"
    );
    // A deleted record gives its bytes back, and the scope is under its budget again.
    store.delete(&key(&greedy, "k0"), false).await.unwrap();
    assert!(matches!(
        claim_and_store(&store, &key(&greedy, "k6"), 0).await,
        Ok(ClaimOutcome::Claimed(_))
    ));
    // A released one too: a fresh claim, released, then a 200 KiB response fits.
    let fp = idempotent_tests::conformance::fp("a");
    let short = Duration::from_secs(10);
    let k7 = key(&greedy, "k7");
    let req = ClaimRequest {
        key: &k7,
        fingerprint: &fp,
        lease: short,
        ttl: short,
        max_stored: LIMIT,
    };
    let ClaimOutcome::Claimed(held) = store.claim(req).await.unwrap() else {
        panic!("not claimed");
    };
    store.release(&k7, held.token).await.unwrap();
    assert!(matches!(
        claim_and_store(&store, &key(&greedy, "k8"), 100 * KIB).await,
        Ok(ClaimOutcome::Claimed(_))
    ));
    assert_eq!(
        replayed_size(&store, &key(&greedy, "k8")).await,
        Some(100 * 1024)
    );
    // Expired records make room first (they still hold the budget until purged), and give
    // everything back.
    clock.advance(Duration::from_secs(60));
    assert!(matches!(
        claim_and_store(&store, &key(&greedy, "k9"), 1000 * KIB).await,
        Ok(ClaimOutcome::Claimed(_))
    ));
    assert_eq!(
        replayed_size(&store, &key(&greedy, "k9")).await,
        Some(1000 * 1024),
        "expired records kept a response from being stored"
    );
    store.purge_expired(usize::MAX).await.unwrap();
    assert_eq!(store.len(), 1);
    clock.advance(Duration::from_secs(60));
    store.purge_expired(usize::MAX).await.unwrap();
    assert_eq!(
        (store.len(), store.bytes()),
        (0, 0),
        "every byte given back"
    );
}

/// The total byte budget: callers together fill it, each claim reserving the route's limit,
/// and then every new claim is refused with `ByteCapacity` until records go; the store never
/// holds more than its budget.
#[tokio::test]
async fn the_total_byte_budget_holds() {
    use idempotent_core::{store::*, *};
    let store = MemoryStore::builder()
        .max_bytes(MIB)
        .max_bytes_per_scope(64 * MIB)
        .build();
    let key = |i: usize| {
        RecordKey::new(
            Scope::new(format!("caller_{i}")).unwrap(),
            "k".parse().unwrap(),
        )
    };
    let mut refused = None;
    for i in 0..20 {
        match claim_and_store(&store, &key(i), 200 * KIB).await {
            Ok(ClaimOutcome::Claimed(_)) => {}
            Ok(other) => panic!("{other:?}"),
            Err(e) => {
                refused = Some((i, e));
                break;
            }
        }
    }
    let Some((at, error)) = refused else {
        panic!("20 callers stored 200 KiB each (4 MiB) under a 1 MiB total budget");
    };
    assert!(
        matches!(error, StoreError::ByteCapacity { max_bytes: MIB }),
        "{error:?}"
    );
    assert_eq!(at, 4, "refused at claim {at}");
    assert_eq!(replayed_size(&store, &key(3)).await, Some(200 * 1024));
    assert!(store.bytes() <= MIB, "{}", store.bytes());
    store.delete(&key(0), false).await.unwrap();
    assert!(matches!(
        claim_and_store(&store, &key(7), 100 * KIB).await,
        Ok(ClaimOutcome::Claimed(_))
    ));
    assert_eq!(replayed_size(&store, &key(7)).await, Some(100 * 1024));
}

/// Concurrent claims and completes: every claim admitted stores its response (never the
/// marker), each claim reserves its limit when admitted, so no more are admitted than the
/// budget holds and the store never goes past it (issue 49: claims were admitted against
/// their bare size, so all of them were, and their responses took the store far past its
/// budget); the bytes charged add up: deleting every record gives back every byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn byte_budget_holds_under_concurrent_completes() {
    use idempotent_core::store::*;
    const TASKS: usize = 64;
    let store = MemoryStore::builder().max_bytes(MIB).build();
    let barrier = Arc::new(tokio::sync::Barrier::new(TASKS));
    let tasks: Vec<_> = (0..TASKS)
        .map(|i| {
            let (store, barrier) = (store.clone(), barrier.clone());
            tokio::spawn(async move {
                let key = idempotent_tests::conformance::unique_key(&format!("b{i}"));
                barrier.wait().await;
                let out = claim_and_store_within(&store, &key, 100 * KIB, 100 * KIB).await;
                assert!(store.bytes() <= MIB, "{} bytes charged", store.bytes());
                match out {
                    Ok(ClaimOutcome::Claimed(_)) => {
                        let replayed = replayed_size(&store, &key).await;
                        assert_eq!(replayed, Some(100 * 1024), "not stored: {replayed:?}");
                        Some(key)
                    }
                    Err(StoreError::ByteCapacity { max_bytes: MIB }) => None,
                    other => panic!("{other:?}"),
                }
            })
        })
        .collect();
    let mut stored = Vec::new();
    for t in tasks {
        stored.extend(t.await.unwrap());
    }
    // About 100 KiB per record: ten fit under the budget, and no more.
    assert_eq!(stored.len(), 10, "{} admitted", stored.len());
    assert!(store.bytes() <= MIB, "{}", store.bytes());
    for key in &stored {
        store.delete(key, false).await.unwrap();
    }
    assert_eq!((store.len(), store.bytes()), (0, 0));
}

/// Issue 49 (4): one caller's 300 concurrent requests for 1 MiB responses (the default
/// `max_response`) cannot take the store past its budgets: at most its own budget's worth
/// of claims is admitted (the rest are refused for the scope's budget, 503), so the store
/// stays far under its total and every other caller's new keys go on. Before, every claim
/// was admitted against its bare size and their responses took the store past its 256 MiB
/// total, refusing everyone's new keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_callers_concurrent_claims_stay_within_its_budget() {
    use idempotent_core::store::*;
    use idempotent_core::*;
    const TASKS: usize = 300;
    let store = MemoryStore::new();
    let barrier = Arc::new(tokio::sync::Barrier::new(TASKS));
    let greedy = Scope::new("greedy").unwrap();
    let tasks: Vec<_> = (0..TASKS)
        .map(|i| {
            let (store, barrier, greedy) = (store.clone(), barrier.clone(), greedy.clone());
            tokio::spawn(async move {
                let key = RecordKey::new(greedy, format!("k{i}").parse().unwrap());
                barrier.wait().await;
                match claim_and_store_within(&store, &key, MIB, MIB).await {
                    Ok(ClaimOutcome::Claimed(_)) => true,
                    Err(StoreError::ScopeByteCapacity { .. }) => false,
                    other => panic!("{other:?}"),
                }
            })
        })
        .collect();
    let mut admitted = 0;
    for t in tasks {
        admitted += usize::from(t.await.unwrap());
    }
    // The scope's budget is 32 MiB: 31 responses of 1 MiB and their records fit.
    assert_eq!(admitted, 31, "{admitted} admitted");
    assert!(store.bytes() <= 32 * MIB, "{}", store.bytes());
    // Everyone else's new keys go on.
    let other = RecordKey::new(Scope::new("other").unwrap(), "k".parse().unwrap());
    assert!(matches!(
        claim_and_store_within(&store, &other, MIB, MIB).await,
        Ok(ClaimOutcome::Claimed(_))
    ));
}

/// Other callers' volume never costs a caller its response: caller B's executions reserved
/// room for their responses when they were admitted, so caller A filling the store while they
/// run cannot take it: B's response is stored and replayed (never the 410 marker: markers are
/// only for responses over the route's `max_response`) and the store never passes its budget.
/// A's new claims are refused while that room is reserved (answered 503 as at the count
/// bound) and admitted once B gives a reservation back (a release).
#[tokio::test]
async fn other_callers_volume_never_turns_a_response_into_a_marker() {
    use idempotent_core::{store::*, *};
    let store = MemoryStore::builder()
        .max_bytes(MIB)
        .max_bytes_per_scope(64 * MIB)
        .build();
    let fp = idempotent_tests::conformance::fp("a");
    let short = Duration::from_secs(10);
    let key = |scope: &str, k: &str| RecordKey::new(Scope::new(scope).unwrap(), k.parse().unwrap());
    let claim = |k: RecordKey, max_stored: u64| {
        let store = store.clone();
        async move {
            store
                .claim(ClaimRequest {
                    key: &k,
                    fingerprint: &fp,
                    lease: short,
                    ttl: short,
                    max_stored,
                })
                .await
        }
    };
    // B's executions start while there is room, each reserving 300 KiB.
    let held = |out: Result<ClaimOutcome, StoreError>| match out {
        Ok(ClaimOutcome::Claimed(lease)) => lease.token,
        other => panic!("{other:?}"),
    };
    let b1 = held(claim(key("b", "b1"), 300 * KIB).await);
    let b2 = held(claim(key("b", "b2"), 300 * KIB).await);
    // A fills what is left: one 200 KiB response (its claim reserving 256 KiB), then refused.
    assert!(matches!(
        claim_and_store(&store, &key("a", "a0"), 200 * KIB).await,
        Ok(ClaimOutcome::Claimed(_))
    ));
    let out = claim_and_store(&store, &key("a", "a1"), 200 * KIB).await;
    assert!(
        matches!(out, Err(StoreError::ByteCapacity { max_bytes: MIB })),
        "{out:?}"
    );
    assert!(store.bytes() <= MIB, "{}", store.bytes());
    // B's first execution finishes with 300 KiB: stored in the room it reserved.
    let response = StoredResponse::new(201, vec![b'x'; 300 * 1024]);
    store
        .complete(&key("b", "b1"), b1, &response.into(), short)
        .await
        .unwrap();
    assert_eq!(
        replayed_size(&store, &key("b", "b1")).await,
        Some(300 * 1024),
        "B's retry must replay its stored response, not the \"not stored\" marker"
    );
    assert!(store.bytes() <= MIB, "{}", store.bytes());
    // Releasing B's other claim gives its reservation back: A's next claim fits.
    store.release(&key("b", "b2"), b2).await.unwrap();
    assert!(matches!(
        claim_and_store(&store, &key("a", "a1"), 200 * KIB).await,
        Ok(ClaimOutcome::Claimed(_))
    ));
    assert_eq!(
        replayed_size(&store, &key("b", "b1")).await,
        Some(300 * 1024)
    );
    assert!(store.bytes() <= MIB, "{}", store.bytes());
}

/// The store's tables are rebuilt as they grow, moving each record (and each scope's
/// usage) by the hash kept beside it, and then churn at a steady size: every record must
/// still be found afterwards, and no removed one, and each scope's count must still be
/// found and bound it. (The store's unit test `kept_hashes_are_the_keys` checks that every
/// kept hash is its key's; this one that entries are placed by it.)
#[tokio::test]
async fn records_stay_found_as_tables_grow_and_churn() {
    use idempotent_core::{IdempotencyKey, store::*};
    // Every key below has a scope of its own: one record each, so a second is refused.
    let store = MemoryStore::builder().max_per_scope(1).build();
    let fp = idempotent_tests::conformance::fp("churn");
    let ttl = Duration::from_secs(3600);
    let claim = async |key: &RecordKey| {
        store
            .claim(ClaimRequest {
                key,
                fingerprint: &fp,
                lease: ttl,
                ttl,
                max_stored: 0,
            })
            .await
    };
    // Growth: 20,000 records over the shards (about a thousand each), several doublings.
    let mut live = std::collections::VecDeque::new();
    for i in 0..20_000 {
        let key = idempotent_tests::conformance::unique_key(&format!("grow-{i}"));
        assert!(matches!(claim(&key).await, Ok(ClaimOutcome::Claimed(_))));
        live.push_back(key);
    }
    // Churn at a steady size: a new record in, the oldest out (the removed slots mostly
    // become empty again, so the tables are rebuilt only by growing).
    let mut gone = Vec::new();
    for i in 0..60_000 {
        let key = idempotent_tests::conformance::unique_key(&format!("churn-{i}"));
        assert!(matches!(claim(&key).await, Ok(ClaimOutcome::Claimed(_))));
        live.push_back(key);
        let oldest = live.pop_front().unwrap();
        assert!(matches!(
            store.delete(&oldest, true).await,
            Ok(Deleted::Deleted(_))
        ));
        if i % 10 == 0 {
            gone.push(oldest);
        }
    }
    assert_eq!(store.len(), 20_000);
    for key in &live {
        assert!(
            matches!(claim(key).await, Ok(ClaimOutcome::InProgress { .. })),
            "a live record was lost"
        );
    }
    let sibling = |key: &RecordKey| {
        RecordKey::new(
            key.scope.clone(),
            IdempotencyKey::parse(b"sibling").unwrap(),
        )
    };
    for key in &live {
        assert!(
            matches!(
                claim(&sibling(key)).await,
                Err(StoreError::ScopeCapacity { max_per_scope: 1 })
            ),
            "a scope's count was lost"
        );
    }
    for key in &gone {
        assert!(
            matches!(claim(key).await, Ok(ClaimOutcome::Claimed(_))),
            "a deleted record was still found"
        );
        assert!(
            matches!(
                claim(&sibling(key)).await,
                Err(StoreError::ScopeCapacity { max_per_scope: 1 })
            ),
            "a scope's count was lost"
        );
    }
}

/// Issue 49 (6): a scope's text is held twice (in each record's key, and once in the scope's
/// usage entry), and both copies are charged: the second with the scope's first record, given
/// back with its last. Before, the usage entry's copy was not charged, so callers with long
/// identities held memory no budget counted.
#[tokio::test]
async fn both_copies_of_a_scope_are_charged() {
    use idempotent_core::store::*;
    use idempotent_core::*;
    let store = MemoryStore::new();
    let scope = Scope::new("s".repeat(200)).unwrap();
    let key = |k: &str| RecordKey::new(scope.clone(), k.parse().unwrap());
    let record = MemoryStore::RECORD_OVERHEAD + 200 + 2 + 33;
    let usage = MemoryStore::SCOPE_OVERHEAD + 200;
    let fp = idempotent_tests::conformance::fp("a");
    let claim = |k: RecordKey| {
        let (store, fp) = (store.clone(), fp);
        async move {
            let long = Duration::from_secs(60);
            let req = ClaimRequest {
                key: &k,
                fingerprint: &fp,
                lease: long,
                ttl: long,
                max_stored: 0,
            };
            assert!(matches!(
                store.claim(req).await,
                Ok(ClaimOutcome::Claimed(_))
            ));
        }
    };
    claim(key("k1")).await;
    assert_eq!(
        store.bytes(),
        record + usage,
        "one record and the scope's usage"
    );
    claim(key("k2")).await;
    assert_eq!(
        store.bytes(),
        2 * record + usage,
        "the usage is charged once"
    );
    store.delete(&key("k1"), true).await.unwrap();
    store.delete(&key("k2"), true).await.unwrap();
    assert_eq!(store.bytes(), 0, "given back with the scope's last record");
}

/// Review of issue 49: a claim whose lease ran out (its execution crashed, or gave up on its
/// complete) gives its reservation back at the next purge (a claim refused for room runs
/// one), so a burst of executions that died does not hold its caller's budget until their
/// records expire; its record stays, and a retry takes it over and reserves again.
#[tokio::test]
async fn a_lapsed_lease_gives_its_reservation_back() {
    use idempotent_core::{clock::*, store::*, *};
    let clock = Arc::new(ManualClock::new());
    let store = MemoryStore::builder()
        .max_bytes_per_scope(MIB)
        .clock(clock.clone())
        .build();
    let fp = idempotent_tests::conformance::fp("a");
    let caller = Scope::new("caller").unwrap();
    let key = |k: &str| RecordKey::new(caller.clone(), k.parse().unwrap());
    let claim = |k: RecordKey| {
        let store = store.clone();
        async move {
            store
                .claim(ClaimRequest {
                    key: &k,
                    fingerprint: &fp,
                    lease: Duration::from_secs(10),
                    ttl: Duration::from_secs(3600),
                    max_stored: 400 * KIB,
                })
                .await
        }
    };
    // Two executions reserve 800 KiB of the caller's 1 MiB, then die.
    for k in ["a", "b"] {
        assert!(matches!(claim(key(k)).await, Ok(ClaimOutcome::Claimed(_))));
    }
    let out = claim(key("c")).await;
    assert!(
        matches!(out, Err(StoreError::ScopeByteCapacity { .. })),
        "{out:?}"
    );
    // Their leases run out: the next claim's purge gives their reservations back.
    clock.advance(Duration::from_secs(11));
    assert!(matches!(
        claim(key("c")).await,
        Ok(ClaimOutcome::Claimed(_))
    ));
    // Their records are still there, and a retry takes one over (reserving again).
    let again = claim(key("a")).await.unwrap();
    assert!(matches!(
        again,
        ClaimOutcome::Claimed(Lease {
            took_over: true,
            ..
        })
    ));
    assert!(store.bytes() < 2 * 400 * KIB + 2 * KIB, "{}", store.bytes());
}
