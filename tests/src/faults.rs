//! A store wrapper that counts every call and fails the ones a test asks it to.

use idempotent_core::{
    Store, StoreError, store::ClaimOutcome, store::ClaimRequest, store::Deleted, store::LeaseToken,
    store::Record, store::RecordKey, store::StoredOutcome,
};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

/// Wraps a real store; counts claims, completes and releases, can delay the answer of claims,
/// and makes the next `fail_claims` claims and the next `fail_completes` completes fail with
/// [`StoreError::Unavailable`] before they reach the store (`usize::MAX`: all of them).
/// [`FaultyStore::injected`] says how many it failed.
pub struct FaultyStore {
    inner: Arc<dyn Store>,
    claim_delay_ms: AtomicUsize,
    extend_delay_ms: AtomicUsize,
    finish_delay_ms: AtomicUsize,
    fail_claims: AtomicUsize,
    fail_completes: AtomicUsize,
    injected: AtomicUsize,
    claims: AtomicUsize,
    completes: AtomicUsize,
    releases: AtomicUsize,
    purges: AtomicUsize,
    extends: AtomicUsize,
}

/// The injected failure.
#[derive(Debug, thiserror::Error)]
#[error("injected failure")]
pub struct Injected;

impl FaultyStore {
    /// Wraps `inner`, failing nothing yet.
    pub fn new(inner: impl Store) -> Arc<Self> {
        Arc::new(FaultyStore {
            inner: Arc::new(inner),
            claim_delay_ms: AtomicUsize::new(0),
            extend_delay_ms: AtomicUsize::new(0),
            finish_delay_ms: AtomicUsize::new(0),
            extends: AtomicUsize::new(0),
            fail_claims: AtomicUsize::new(0),
            fail_completes: AtomicUsize::new(0),
            injected: AtomicUsize::new(0),
            claims: AtomicUsize::new(0),
            completes: AtomicUsize::new(0),
            releases: AtomicUsize::new(0),
            purges: AtomicUsize::new(0),
        })
    }

    /// Fails the next `n` claims (`usize::MAX`: every one from now on; 0: none).
    pub fn fail_next_claims(&self, n: usize) {
        self.fail_claims.store(n, Ordering::SeqCst);
    }

    /// Fails the next `n` completes (`usize::MAX`: every one from now on).
    pub fn fail_next_completes(&self, n: usize) {
        self.fail_completes.store(n, Ordering::SeqCst);
    }

    /// Makes every claim answer `delay` after the real store has applied it (a slow network
    /// between a committed claim and its answer).
    pub fn delay_claims(&self, delay: Duration) {
        self.claim_delay_ms.store(
            usize::try_from(delay.as_millis()).unwrap_or(usize::MAX),
            Ordering::SeqCst,
        );
    }

    /// Makes every lease extension take `delay` before it reaches the store.
    pub fn delay_extends(&self, delay: Duration) {
        self.extend_delay_ms.store(
            usize::try_from(delay.as_millis()).unwrap_or(usize::MAX),
            Ordering::SeqCst,
        );
    }

    /// Makes every completion and release take `delay` before it reaches the store (a
    /// connection that hangs while extensions, on another connection, still answer).
    pub fn delay_finishes(&self, delay: Duration) {
        self.finish_delay_ms.store(
            usize::try_from(delay.as_millis()).unwrap_or(usize::MAX),
            Ordering::SeqCst,
        );
    }

    /// Failures injected so far.
    pub fn injected(&self) -> usize {
        self.injected.load(Ordering::SeqCst)
    }

    /// Claims that reached this store.
    pub fn claims(&self) -> usize {
        self.claims.load(Ordering::SeqCst)
    }

    /// Completes attempted (failed ones included).
    pub fn completes(&self) -> usize {
        self.completes.load(Ordering::SeqCst)
    }

    /// Sweeps (`purge_expired` calls) so far.
    pub fn purges(&self) -> usize {
        self.purges.load(Ordering::SeqCst)
    }

    /// Lease extensions attempted.
    pub fn extends(&self) -> usize {
        self.extends.load(Ordering::SeqCst)
    }

    /// Releases attempted.
    pub fn releases(&self) -> usize {
        self.releases.load(Ordering::SeqCst)
    }
}

impl FaultyStore {
    /// Waits out [`FaultyStore::delay_finishes`]' delay.
    async fn finish_delay(&self) {
        let delay = self.finish_delay_ms.load(Ordering::SeqCst);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay as u64)).await;
        }
    }
}

/// Takes one failure from `budget` (`usize::MAX` never runs out); whether there was one.
fn take_one(budget: &AtomicUsize) -> bool {
    budget
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| match n {
            0 => None,
            usize::MAX => Some(usize::MAX),
            n => Some(n - 1),
        })
        .is_ok()
}

#[async_trait::async_trait]
impl Store for FaultyStore {
    async fn claim(&self, req: ClaimRequest<'_>) -> Result<ClaimOutcome, StoreError> {
        self.claim_with_expiry(req)
            .await
            .map(|(outcome, _)| outcome)
    }

    async fn claim_with_expiry(
        &self,
        req: ClaimRequest<'_>,
    ) -> Result<(ClaimOutcome, Option<Duration>), StoreError> {
        self.claims.fetch_add(1, Ordering::SeqCst);
        if take_one(&self.fail_claims) {
            self.injected.fetch_add(1, Ordering::SeqCst);
            return Err(StoreError::unavailable(Injected));
        }
        let outcome = self.inner.claim_with_expiry(req).await;
        let delay = self.claim_delay_ms.load(Ordering::SeqCst);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay as u64)).await;
        }
        outcome
    }

    async fn complete(
        &self,
        key: &RecordKey,
        token: LeaseToken,
        outcome: &StoredOutcome,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        self.completes.fetch_add(1, Ordering::SeqCst);
        if take_one(&self.fail_completes) {
            self.injected.fetch_add(1, Ordering::SeqCst);
            return Err(StoreError::unavailable(Injected));
        }
        self.finish_delay().await;
        self.inner.complete(key, token, outcome, ttl).await
    }

    async fn release(&self, key: &RecordKey, token: LeaseToken) -> Result<(), StoreError> {
        self.releases.fetch_add(1, Ordering::SeqCst);
        self.finish_delay().await;
        self.inner.release(key, token).await
    }

    async fn extend(
        &self,
        key: &RecordKey,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<SystemTime, StoreError> {
        self.extends.fetch_add(1, Ordering::SeqCst);
        let delay = self.extend_delay_ms.load(Ordering::SeqCst);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay as u64)).await;
        }
        self.inner.extend(key, token, lease).await
    }

    async fn delete(&self, key: &RecordKey, force: bool) -> Result<Deleted, StoreError> {
        self.inner.delete(key, force).await
    }
    async fn purge_expired(&self, batch: usize) -> Result<u64, StoreError> {
        self.purges.fetch_add(1, Ordering::SeqCst);
        self.inner.purge_expired(batch).await
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        self.inner.get(key).await
    }
    fn transactional(&self) -> Option<&dyn std::any::Any> {
        self.inner.transactional()
    }
    fn expires_by_itself(&self) -> bool {
        self.inner.expires_by_itself()
    }
}
