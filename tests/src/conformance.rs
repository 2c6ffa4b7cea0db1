//! The store conformance suite: what every [`Store`] must do, written once.
//!
//! Each case takes a [`Fixture`], asks it for a fresh store and asserts one promise of the
//! [`Store`] trait's documentation.

use crate::Fixture;
use idempotent_core::{
    IdempotencyKey, Scope, Store, StoreError, fingerprint::Fingerprint,
    fingerprint::FingerprintInput, store::ClaimOutcome, store::ClaimRequest, store::Deleted,
    store::Lease, store::RecordKey, store::RecordState, store::StoredOutcome,
    store::StoredResponse,
};
use std::sync::Arc;
use std::time::Duration;

const TTL: Duration = Duration::from_secs(3600);

/// A fingerprint made from a label.
pub fn fp(label: &str) -> Fingerprint {
    Fingerprint::compute(&FingerprintInput {
        method: "POST",
        path: "/conformance",
        query: None,
        content_type: Some("text/plain"),
        body: label.as_bytes(),
    })
}

/// A record key with a unique scope, so cases never collide even on a shared store.
pub fn unique_key(key: &str) -> RecordKey {
    let scope =
        Scope::new(format!("acct_{}", idempotent_core::uuid::Uuid::new_v4())).expect("valid scope");
    RecordKey::new(
        scope,
        IdempotencyKey::parse(key.as_bytes()).expect("valid key"),
    )
}

async fn claim(
    store: &dyn Store,
    key: &RecordKey,
    fingerprint: &Fingerprint,
    lease: Duration,
    ttl: Duration,
) -> ClaimOutcome {
    store
        .claim(ClaimRequest {
            key,
            fingerprint,
            lease,
            ttl,
            max_stored: 0,
        })
        .await
        .expect("claim")
}

fn claimed(outcome: ClaimOutcome) -> Lease {
    match outcome {
        ClaimOutcome::Claimed(lease) => lease,
        other => panic!("expected Claimed, got {other:?}"),
    }
}

fn response(body: &str) -> StoredOutcome {
    StoredResponse::new(201, body)
        .with_header("content-type", "application/json")
        .into()
}

/// A new key is claimed, not taken over, and reads back as in progress with that token.
pub async fn new_claim(f: &impl Fixture) {
    let store = f.fresh().await;
    let key = unique_key("new");
    let lease = claimed(claim(&*store, &key, &fp("a"), f.lease(), TTL).await);
    assert!(!lease.took_over);
    let record = store.get(&key).await.expect("get").expect("record exists");
    assert_eq!(record.fingerprint, fp("a"));
    match record.state {
        RecordState::InProgress { token, .. } => assert_eq!(token, lease.token),
        other => panic!("expected in progress, got {other:?}"),
    }
}

/// After completion, the same fingerprint replays exactly what was stored.
pub async fn replay_returns_stored_outcome(f: &impl Fixture) {
    let store = f.fresh().await;
    let key = unique_key("replay");
    let lease = claimed(claim(&*store, &key, &fp("a"), f.lease(), TTL).await);
    let outcome = response(r#"{"id":"ch_1"}"#);
    store
        .complete(&key, lease.token, &outcome, TTL)
        .await
        .expect("complete");
    for _ in 0..3 {
        assert_eq!(
            claim(&*store, &key, &fp("a"), f.lease(), TTL).await,
            ClaimOutcome::Replay(outcome.clone())
        );
    }
    // Completing twice is refused: the record is no longer in progress.
    assert!(matches!(
        store.complete(&key, lease.token, &outcome, TTL).await,
        Err(StoreError::StaleLease)
    ));
}

/// A replay reports what is left of its record's life (`Store::claim_with_expiry`, what a
/// replay cache bounds its copy by): at most the ttl, more than nothing; nothing for other
/// outcomes.
pub async fn replays_report_what_is_left_of_their_record(f: &impl Fixture) {
    let store = f.fresh().await;
    let key = unique_key("lives");
    let ttl = Duration::from_secs(60);
    let (a, other_fp) = (fp("a"), fp("b"));
    let req = |fingerprint| ClaimRequest {
        key: &key,
        fingerprint,
        lease: f.lease(),
        ttl,
        max_stored: 0,
    };
    let (first, lives) = store.claim_with_expiry(req(&a)).await.expect("claim");
    assert_eq!(lives, None);
    let lease = claimed(first);
    let (busy, lives) = store.claim_with_expiry(req(&a)).await.expect("claim");
    assert!(matches!(busy, ClaimOutcome::InProgress { .. }), "{busy:?}");
    assert_eq!(lives, None);
    let outcome = response("lives");
    store
        .complete(&key, lease.token, &outcome, ttl)
        .await
        .expect("complete");
    let (replay, lives) = store.claim_with_expiry(req(&a)).await.expect("claim");
    assert_eq!(replay, ClaimOutcome::Replay(outcome));
    let lives = lives.expect("a store of this crate reports a replayed record's life");
    // The record expires no sooner than a ttl after its complete and no later than lease +
    // ttl after its claim (the first claim's expiry).
    assert!(
        lives > ttl - Duration::from_secs(10) && lives <= ttl + f.lease(),
        "{lives:?}"
    );
    // What is left, not the ttl: it shrinks as the store's time passes.
    f.advance(Duration::from_millis(600)).await;
    let (_, later) = store.claim_with_expiry(req(&a)).await.expect("claim");
    let later = later.expect("reported again");
    assert!(
        later + Duration::from_millis(400) <= lives,
        "{later:?} after {lives:?}"
    );
    let (other, lives) = store
        .claim_with_expiry(req(&other_fp))
        .await
        .expect("claim");
    assert!(matches!(other, ClaimOutcome::Mismatch { .. }), "{other:?}");
    assert_eq!(lives, None);
}

/// A second claim while the first holds a live lease is told to retry within the lease.
pub async fn in_progress_reports_retry_after(f: &impl Fixture) {
    let store = f.fresh().await;
    let key = unique_key("busy");
    claimed(claim(&*store, &key, &fp("a"), f.lease(), TTL).await);
    match claim(&*store, &key, &fp("a"), f.lease(), TTL).await {
        // The lease was just taken: some of it is left (0 would tell a client to retry at
        // once, into another 409), and never more than the lease.
        ClaimOutcome::InProgress { retry_after } => assert!(
            retry_after > Duration::ZERO && retry_after <= f.lease(),
            "retry_after {retry_after:?} outside (0, {:?}] for a live lease",
            f.lease()
        ),
        other => panic!("expected InProgress, got {other:?}"),
    }
}

/// Same key, different fingerprint, after completion: mismatch.
pub async fn mismatch_done(f: &impl Fixture) {
    let store = f.fresh().await;
    let key = unique_key("mm");
    let lease = claimed(claim(&*store, &key, &fp("a"), f.lease(), TTL).await);
    store
        .complete(&key, lease.token, &response("x"), TTL)
        .await
        .expect("complete");
    assert_eq!(
        claim(&*store, &key, &fp("b"), f.lease(), TTL).await,
        ClaimOutcome::Mismatch { in_progress: false }
    );
}

/// Same key, different fingerprint, while in progress: mismatch.
pub async fn mismatch_in_progress(f: &impl Fixture) {
    let store = f.fresh().await;
    let key = unique_key("mm2");
    claimed(claim(&*store, &key, &fp("a"), f.lease(), TTL).await);
    assert_eq!(
        claim(&*store, &key, &fp("b"), f.lease(), TTL).await,
        ClaimOutcome::Mismatch { in_progress: true }
    );
}

/// Once the lease runs out, a claim with the same fingerprint takes over with a new token.
pub async fn lease_takeover(f: &impl Fixture) {
    let store = f.fresh().await;
    let key = unique_key("take");
    let first = claimed(claim(&*store, &key, &fp("a"), f.lease(), TTL).await);
    f.advance(f.lease() + Duration::from_millis(200)).await;
    let second = claimed(claim(&*store, &key, &fp("a"), f.lease(), TTL).await);
    assert!(second.took_over);
    assert_ne!(first.token, second.token);
    assert!(matches!(
        claim(&*store, &key, &fp("a"), f.lease(), TTL).await,
        ClaimOutcome::InProgress { .. }
    ));
}

/// A run-out lease is not taken over by a request with a different fingerprint.
pub async fn lease_takeover_needs_same_fingerprint(f: &impl Fixture) {
    let store = f.fresh().await;
    let key = unique_key("take2");
    claimed(claim(&*store, &key, &fp("a"), f.lease(), TTL).await);
    f.advance(f.lease() + Duration::from_millis(200)).await;
    assert_eq!(
        claim(&*store, &key, &fp("b"), f.lease(), TTL).await,
        ClaimOutcome::Mismatch { in_progress: true }
    );
}

/// After a takeover, the stale owner can neither complete, release nor extend.
pub async fn fencing_after_takeover(f: &impl Fixture) {
    let store = f.fresh().await;
    let key = unique_key("fence");
    let old = claimed(claim(&*store, &key, &fp("a"), f.lease(), TTL).await);
    f.advance(f.lease() + Duration::from_millis(200)).await;
    let new = claimed(claim(&*store, &key, &fp("a"), f.lease(), TTL).await);
    assert!(matches!(
        store
            .complete(&key, old.token, &response("stale"), TTL)
            .await,
        Err(StoreError::StaleLease)
    ));
    assert!(matches!(
        store.release(&key, old.token).await,
        Err(StoreError::StaleLease)
    ));
    assert!(matches!(
        store.extend(&key, old.token, f.lease()).await,
        Err(StoreError::StaleLease)
    ));
    // The new owner is untouched and completes normally.
    store
        .complete(&key, new.token, &response("fresh"), TTL)
        .await
        .expect("new owner completes");
    assert_eq!(
        claim(&*store, &key, &fp("a"), f.lease(), TTL).await,
        ClaimOutcome::Replay(response("fresh"))
    );
}

/// A record past its ttl counts as absent: it reads as `None` and any request reclaims it.
pub async fn ttl_expiry_reclaims(f: &impl Fixture) {
    let store = f.fresh().await;
    let key = unique_key("ttl");
    let ttl = f.lease() * 2;
    let lease = claimed(claim(&*store, &key, &fp("a"), f.lease(), ttl).await);
    store
        .complete(&key, lease.token, &response("old"), ttl)
        .await
        .expect("complete");
    assert!(store.get(&key).await.expect("get").is_some());
    // The ttl is a floor: the claim's expiry (now + lease + ttl) may outlast it.
    f.advance(f.lease() + ttl + Duration::from_millis(200))
        .await;
    assert_eq!(store.get(&key).await.expect("get"), None);
    // A different fingerprint is fine now: the old record is gone.
    let again = claimed(claim(&*store, &key, &fp("b"), f.lease(), TTL).await);
    assert_ne!(again.token, lease.token);
}

/// The same key under two scopes is two records.
pub async fn scope_isolation(f: &impl Fixture) {
    let store = f.fresh().await;
    let a = unique_key("shared-key");
    let b = RecordKey::new(
        Scope::new(format!("{}-other", a.scope.as_str())).expect("scope"),
        a.key.clone(),
    );
    let la = claimed(claim(&*store, &a, &fp("a"), f.lease(), TTL).await);
    let lb = claimed(claim(&*store, &b, &fp("b"), f.lease(), TTL).await);
    store
        .complete(&a, la.token, &response("for a"), TTL)
        .await
        .expect("complete a");
    // b is still in progress, and a's token cannot touch it.
    assert!(matches!(
        claim(&*store, &b, &fp("b"), f.lease(), TTL).await,
        ClaimOutcome::InProgress { .. }
    ));
    assert!(matches!(
        store.release(&b, la.token).await,
        Err(StoreError::StaleLease)
    ));
    store.release(&b, lb.token).await.expect("release b");
    assert_eq!(
        claim(&*store, &a, &fp("a"), f.lease(), TTL).await,
        ClaimOutcome::Replay(response("for a"))
    );
    // The unscoped namespace is separate too.
    let u = RecordKey::new(Scope::unscoped(), a.key.clone());
    let lu = claimed(claim(&*store, &u, &fp("u"), f.lease(), TTL).await);
    store.release(&u, lu.token).await.expect("release unscoped");
}

/// (scope, key) pairs that a naive `scope + ":" + key` (or `scope + key`) would join into the
/// same string are different records: scope `a:b` with key `c`, scope `a` with key `b:c`,
/// scope `a:` with key `b:c`... Each is claimed and completed on its own and replays its own
/// response.
pub async fn scope_and_key_never_collide(f: &impl Fixture) {
    let store = f.fresh().await;
    let base = unique_key("x").scope.as_str().to_owned();
    let pairs = [
        (format!("{base}:a:b"), "c"),
        (format!("{base}:a"), "b:c"),
        (format!("{base}:a:"), "b:c"),
        (format!("{base}:a"), ":b:c"),
        (format!("{base}:ab"), "c"),
        (format!("{base}:a"), "bc"),
    ];
    let keys: Vec<RecordKey> = pairs
        .iter()
        .map(|(scope, key)| {
            RecordKey::new(
                Scope::new(scope.clone()).expect("scope"),
                IdempotencyKey::parse(key.as_bytes()).expect("key"),
            )
        })
        .collect();
    for (i, k) in keys.iter().enumerate() {
        let lease = claimed(claim(&*store, k, &fp("same"), f.lease(), TTL).await);
        store
            .complete(k, lease.token, &response(&format!("pair {i}")), TTL)
            .await
            .expect("complete");
    }
    for (i, k) in keys.iter().enumerate() {
        assert_eq!(
            claim(&*store, k, &fp("same"), f.lease(), TTL).await,
            ClaimOutcome::Replay(response(&format!("pair {i}"))),
            "pair {i}: {k:?}"
        );
    }
}

/// `delete`: a finished record is deleted and returned; an in-progress one only with `force`
/// (and its old token is then refused by the fence); an absent one is `Absent`; a deleted
/// key is new again.
pub async fn delete_needs_force_for_in_progress(f: &impl Fixture) {
    let store = f.fresh().await;
    let done = unique_key("done");
    let lease = claimed(claim(&*store, &done, &fp("a"), f.lease(), TTL).await);
    store
        .complete(&done, lease.token, &response("stored"), TTL)
        .await
        .expect("complete");
    match store.delete(&done, false).await.expect("delete") {
        Deleted::Deleted(record) => {
            assert!(matches!(record.state, RecordState::Done { .. }));
            assert_eq!(record.key, done);
        }
        other => panic!("{other:?}"),
    }
    assert!(store.get(&done).await.expect("get").is_none());
    assert_eq!(
        store.delete(&done, false).await.expect("delete"),
        Deleted::Absent
    );
    assert!(matches!(
        claim(&*store, &done, &fp("a"), f.lease(), TTL).await,
        ClaimOutcome::Claimed(_)
    ));

    let running = unique_key("running");
    let lease = claimed(claim(&*store, &running, &fp("a"), f.lease(), TTL).await);
    match store.delete(&running, false).await.expect("delete") {
        Deleted::InProgress(record) => {
            assert!(matches!(record.state, RecordState::InProgress { .. }));
        }
        other => panic!("{other:?}"),
    }
    assert!(
        store.get(&running).await.expect("get").is_some(),
        "kept without force"
    );
    assert!(matches!(
        store.delete(&running, true).await.expect("delete"),
        Deleted::Deleted(_)
    ));
    assert!(matches!(
        store
            .complete(&running, lease.token, &response("late"), TTL)
            .await,
        Err(StoreError::StaleLease)
    ));
}

/// Purge deletes only expired records, at most `batch` per call (a store that expires records
/// by itself has already deleted them, and purges nothing).
pub async fn purge_in_batches(f: &impl Fixture) {
    let store = f.fresh().await;
    let short = f.lease() * 2;
    let mut expiring = Vec::new();
    for i in 0..25 {
        let key = unique_key(&format!("p{i}"));
        let lease = claimed(claim(&*store, &key, &fp("a"), f.lease(), short).await);
        store
            .complete(&key, lease.token, &response("x"), short)
            .await
            .expect("complete");
        expiring.push(key);
    }
    let keep = unique_key("keep");
    let kl = claimed(claim(&*store, &keep, &fp("a"), f.lease(), TTL).await);
    assert_eq!(
        store.purge_expired(10).await.expect("purge"),
        0,
        "nothing expired yet"
    );
    f.advance(f.lease() + short + Duration::from_millis(200))
        .await;
    // `keep` has a live lease of f.lease() from its own claim; extend it so it survives.
    store
        .extend(&keep, kl.token, TTL)
        .await
        .expect("extend keep");
    if store.expires_by_itself() {
        // Redis: the records went when their ttl did; there is nothing left to purge.
        for key in &expiring {
            assert_eq!(store.get(key).await.expect("get"), None);
        }
        assert_eq!(store.purge_expired(10).await.expect("purge"), 0);
        assert!(store.get(&keep).await.expect("get").is_some());
        return;
    }
    let mut total = 0;
    loop {
        let n = store.purge_expired(10).await.expect("purge");
        assert!(n <= 10, "batch bound broken: {n}");
        if n == 0 {
            break;
        }
        total += n;
    }
    assert_eq!(total, 25);
    assert!(store.get(&keep).await.expect("get").is_some());
}

/// Release deletes the record: the next claim starts afresh (any fingerprint).
pub async fn release_frees_key(f: &impl Fixture) {
    let store = f.fresh().await;
    let key = unique_key("rel");
    let lease = claimed(claim(&*store, &key, &fp("a"), f.lease(), TTL).await);
    store.release(&key, lease.token).await.expect("release");
    assert_eq!(store.get(&key).await.expect("get"), None);
    assert!(matches!(
        store.release(&key, lease.token).await,
        Err(StoreError::StaleLease)
    ));
    let again = claimed(claim(&*store, &key, &fp("b"), f.lease(), TTL).await);
    assert!(!again.took_over);
}

/// Extending the lease keeps other claimers out past the original lease.
pub async fn extend_keeps_lease(f: &impl Fixture) {
    let store = f.fresh().await;
    let key = unique_key("ext");
    let lease = claimed(claim(&*store, &key, &fp("a"), f.lease(), TTL).await);
    store
        .extend(&key, lease.token, f.lease() * 4)
        .await
        .expect("extend");
    f.advance(f.lease() + Duration::from_millis(200)).await;
    assert!(matches!(
        claim(&*store, &key, &fp("a"), f.lease(), TTL).await,
        ClaimOutcome::InProgress { .. }
    ));
    store
        .complete(&key, lease.token, &response("ok"), TTL)
        .await
        .expect("owner still completes");
}

/// Fenced writes to a record that never existed are stale, not errors of another kind.
pub async fn stale_token_on_absent_record(f: &impl Fixture) {
    let store = f.fresh().await;
    let key = unique_key("ghost");
    let token = idempotent_core::store::LeaseToken::generate();
    assert!(matches!(
        store.complete(&key, token, &response("x"), TTL).await,
        Err(StoreError::StaleLease)
    ));
    assert!(matches!(
        store.release(&key, token).await,
        Err(StoreError::StaleLease)
    ));
    assert!(matches!(
        store.extend(&key, token, TTL).await,
        Err(StoreError::StaleLease)
    ));
    assert_eq!(store.get(&key).await.expect("get"), None);
}

/// The "response too large" marker is stored and replayed as such.
pub async fn oversized_marker_round_trips(f: &impl Fixture) {
    let store = f.fresh().await;
    let key = unique_key("big");
    let lease = claimed(claim(&*store, &key, &fp("a"), f.lease(), TTL).await);
    let marker = StoredOutcome::Oversized {
        status: 200,
        size: 5 << 20,
    };
    store
        .complete(&key, lease.token, &marker, TTL)
        .await
        .expect("complete");
    assert_eq!(
        claim(&*store, &key, &fp("a"), f.lease(), TTL).await,
        ClaimOutcome::Replay(marker)
    );
}

/// Repeated headers keep their order; binary bodies and header values survive.
pub async fn headers_and_binary_body_round_trip(f: &impl Fixture) {
    let store = f.fresh().await;
    let key = unique_key("hdr");
    let lease = claimed(claim(&*store, &key, &fp("a"), f.lease(), TTL).await);
    let mut body = vec![0_u8, 255, 10, 13];
    body.extend((0..=255).collect::<Vec<u8>>());
    let outcome: StoredOutcome = StoredResponse {
        status: 299,
        headers: vec![
            ("link".into(), b"<a>".to_vec()),
            ("x-multi".into(), b"1".to_vec()),
            ("link".into(), b"<b>".to_vec()),
            ("x-bin".into(), vec![0x80, 0xff]),
        ],
        body,
    }
    .into();
    store
        .complete(&key, lease.token, &outcome, TTL)
        .await
        .expect("complete");
    assert_eq!(
        claim(&*store, &key, &fp("a"), f.lease(), TTL).await,
        ClaimOutcome::Replay(outcome)
    );
}

/// 64 concurrent tasks claim one key: exactly one wins, the rest see it in progress.
pub async fn concurrent_claims_one_winner(f: &impl Fixture) {
    let store = f.fresh().await;
    let key = Arc::new(unique_key("race"));
    let barrier = Arc::new(tokio::sync::Barrier::new(64));
    let tasks: Vec<_> = (0..64)
        .map(|_| {
            let store = Arc::clone(&store);
            let key = Arc::clone(&key);
            let barrier = Arc::clone(&barrier);
            tokio::spawn(async move {
                barrier.wait().await;
                store
                    .claim(ClaimRequest {
                        key: &key,
                        fingerprint: &fp("a"),
                        lease: Duration::from_secs(60),
                        ttl: TTL,
                        max_stored: 0,
                    })
                    .await
            })
        })
        .collect();
    let mut won = 0;
    let mut busy = 0;
    for t in tasks {
        match t.await.expect("task").expect("claim") {
            ClaimOutcome::Claimed(_) => won += 1,
            ClaimOutcome::InProgress { .. } => busy += 1,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!((won, busy), (1, 63));
}

/// A record written under another fingerprint version (the 32-byte layout of version 1,
/// which no release shipped, or a version this release does not know, older or newer: a
/// rolling upgrade that changes the recipe) is matched by its key alone: its digest cannot be
/// compared with this version's, and a retry within its ttl must neither get 422 nor run
/// again. So a finished one replays, one in progress is in progress, and one whose lease ran
/// out is taken over. The stored fingerprint keeps its version. (Issue 49: it was a 422.)
pub async fn other_fingerprint_versions_match_by_key_alone(f: &impl Fixture) {
    let store = f.fresh().await;
    let input = |path, body: &'static [u8]| FingerprintInput {
        method: "POST",
        path,
        query: None,
        content_type: Some("application/json"),
        body,
    };
    let request = Fingerprint::compute(&input("/orders/1/refund", b"{}"));
    // Written by version 1 for the same request, digest and all.
    let key = unique_key("versions");
    let old = Fingerprint::from_stored(request.digest()).expect("32-byte layout");
    assert_eq!(old.version(), 1);
    let lease = claimed(claim(&*store, &key, &old, f.lease(), TTL).await);
    let outcome = response("v1");
    store
        .complete(&key, lease.token, &outcome, TTL)
        .await
        .expect("complete");
    assert_eq!(
        store
            .get(&key)
            .await
            .expect("get")
            .expect("record")
            .fingerprint,
        old
    );
    // This version's fingerprint, of that request or of any other: the stored response.
    for fingerprint in [request, fp("another request")] {
        assert_eq!(
            claim(&*store, &key, &fingerprint, f.lease(), TTL).await,
            ClaimOutcome::Replay(outcome.clone())
        );
    }
    // A version this release does not know, in progress: in progress, then taken over.
    let key2 = unique_key("versions2");
    let future = Fingerprint::from_parts(9, *fp("a").digest());
    claimed(claim(&*store, &key2, &future, f.lease(), TTL).await);
    assert!(matches!(
        claim(&*store, &key2, &fp("a"), f.lease(), TTL).await,
        ClaimOutcome::InProgress { .. }
    ));
    f.advance(f.lease() + Duration::from_millis(200)).await;
    let taken = claimed(claim(&*store, &key2, &fp("a"), f.lease(), TTL).await);
    assert!(taken.took_over);
}
