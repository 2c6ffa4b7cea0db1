//! A lease renewal with a bound: what an execution's heartbeat calls ([`Store::renew`]).
//!
//! A renewal is sent half a lease before the lease ends. The store is fine more often than
//! not when a renewal gets no answer: one pooled connection went silent (a half-open TCP
//! connection, a NAT or proxy that forgot it), or every pooled connection is busy. Waiting on
//! that connection, or on the pool, would let the lease run out under a live handler and a
//! retry take the record over and run it a second time. So:
//!
//! 1. the first attempt ([`Store::extend`]) gets an eighth of the lease, the pool's wait for a
//!    connection included;
//! 2. if it had no answer in time, or failed as unavailable, a second attempt goes at once,
//!    within seven sixteenths of the lease from the start, asking its store for a connection
//!    of its own ([`wants_fresh_connection`]): the SQL stores close the connection the
//!    abandoned attempt held and open a fresh one, outside the pool, for the second; Redis
//!    replaces its connection. (Asked per call, not through a flag the store keeps: two
//!    executions whose renewals hang at once each get a fresh connection, and another
//!    execution's write cannot take it from them.)
//!
//! That leaves a sixteenth of the lease before it runs out, for the heartbeat's next round.
//! A renewal refused by the fence ([`StoreError::StaleLease`]) or reading a corrupt record is
//! final at once. SECURITY.md ("Leases") says what this does and does not cover.

use super::fence::LeaseToken;
use super::record::RecordKey;
use super::{Store, StoreError};
use std::future::Future;
use std::time::{Duration, SystemTime};

tokio::task_local! {
    /// Set around a store write that follows an abandoned one (see [`wants_fresh_connection`]).
    static FRESH: ();
}

/// Whether the store write running now follows one the engine gave up on (a renewal's first
/// attempt had no answer, a complete or release is being tried again): a store that keeps
/// connections should run it on a connection it opens for it, not on one from its pool,
/// whose idle connections may have gone silent like the one abandoned. The SQL stores do.
/// Read it at the start of [`Store::extend`], [`Store::complete`] or [`Store::release`] (it is
/// set for the task the engine runs the write on).
pub fn wants_fresh_connection() -> bool {
    FRESH.try_with(|()| ()).is_ok()
}

/// Runs `write` (a store write that follows an abandoned one) so that
/// [`wants_fresh_connection`] is true inside it.
pub(crate) async fn on_fresh_connection<F: Future>(write: F) -> F::Output {
    FRESH.scope((), write).await
}

/// How long the first attempt of a renewal may take: an eighth of the lease.
pub(crate) fn first_attempt(lease: Duration) -> Duration {
    lease / 8
}

/// How long a whole renewal may take: seven sixteenths of the lease.
pub(crate) fn renewal_bound(lease: Duration) -> Duration {
    lease / 16 * 7
}

/// A lease renewal that got no answer within its bound, on two attempts.
#[derive(Debug, thiserror::Error)]
#[error("no answer to a lease renewal within {0:?}, on two attempts")]
pub struct RenewalTimedOut(pub Duration);

/// [`Store::renew`]'s default: [`Store::extend`] twice at most, bounded as the
/// [module](self) says.
pub(crate) async fn bounded<S: Store + ?Sized>(
    store: &S,
    key: &RecordKey,
    token: LeaseToken,
    lease: Duration,
) -> Result<SystemTime, StoreError> {
    let started = tokio::time::Instant::now();
    let deadline = started + renewal_bound(lease);
    match tokio::time::timeout(first_attempt(lease), store.extend(key, token, lease)).await {
        Ok(Ok(until)) => return Ok(until),
        // Final answers: the fence refused, or the record cannot be read.
        Ok(Err(e @ (StoreError::StaleLease | StoreError::Corrupt(_)))) => return Err(e),
        // No answer in time, or unavailable: once more, on another connection.
        Ok(Err(_)) | Err(_) => {}
    }
    let second = on_fresh_connection(store.extend(key, token, lease));
    match tokio::time::timeout_at(deadline, second).await {
        Ok(answer) => answer,
        Err(_) => Err(StoreError::unavailable(RenewalTimedOut(
            deadline.saturating_duration_since(started),
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{ClaimOutcome, ClaimRequest, Deleted, Record, StoredOutcome};
    use crate::{key::IdempotencyKey, scope::Scope};
    use std::sync::Mutex;

    /// A store whose extends answer as scripted, one script entry per call: `None` never
    /// answers, `Some(Ok)` renews, `Some(Err)` fails as unavailable.
    struct Scripted(Mutex<Vec<Option<bool>>>, Mutex<u32>);

    #[async_trait::async_trait]
    impl Store for Scripted {
        async fn claim(&self, _: ClaimRequest<'_>) -> Result<ClaimOutcome, StoreError> {
            unreachable!()
        }
        async fn complete(
            &self,
            _: &RecordKey,
            _: LeaseToken,
            _: &StoredOutcome,
            _: Duration,
        ) -> Result<(), StoreError> {
            unreachable!()
        }
        async fn release(&self, _: &RecordKey, _: LeaseToken) -> Result<(), StoreError> {
            unreachable!()
        }
        async fn extend(
            &self,
            _: &RecordKey,
            _: LeaseToken,
            _: Duration,
        ) -> Result<SystemTime, StoreError> {
            *self.1.lock().unwrap() += 1;
            let next = self.0.lock().unwrap().remove(0);
            match next {
                None => std::future::pending().await,
                Some(true) => Ok(SystemTime::UNIX_EPOCH),
                Some(false) => Err(StoreError::unavailable(std::io::Error::other("down"))),
            }
        }
        async fn purge_expired(&self, _: usize) -> Result<u64, StoreError> {
            unreachable!()
        }
        async fn get(&self, _: &RecordKey) -> Result<Option<Record>, StoreError> {
            unreachable!()
        }
        async fn delete(&self, _: &RecordKey, _: bool) -> Result<Deleted, StoreError> {
            unreachable!()
        }
    }

    fn key() -> RecordKey {
        RecordKey::new(
            Scope::new("acct").unwrap(),
            IdempotencyKey::parse(b"k").unwrap(),
        )
    }

    async fn renew(script: Vec<Option<bool>>) -> (Result<SystemTime, StoreError>, Duration, u32) {
        let store = Scripted(Mutex::new(script), Mutex::new(0));
        let started = tokio::time::Instant::now();
        let lease = Duration::from_secs(16);
        let out = bounded(&store, &key(), LeaseToken::generate(), lease).await;
        let calls = *store.1.lock().unwrap();
        (out, started.elapsed(), calls)
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_first_attempt_is_given_up_after_an_eighth_and_tried_again() {
        let (out, took, calls) = renew(vec![None, Some(true)]).await;
        assert!(out.is_ok());
        assert_eq!((took, calls), (Duration::from_secs(2), 2));
    }

    #[tokio::test(start_paused = true)]
    async fn two_silent_attempts_end_at_seven_sixteenths() {
        let (out, took, calls) = renew(vec![None, None]).await;
        assert!(matches!(out, Err(StoreError::Unavailable(_))), "{out:?}");
        assert_eq!((took, calls), (Duration::from_secs(7), 2));
    }

    #[tokio::test(start_paused = true)]
    async fn a_failure_is_tried_again_at_once_and_a_renewal_is_not_repeated() {
        let (out, took, calls) = renew(vec![Some(false), Some(true)]).await;
        assert!(out.is_ok());
        assert_eq!((took, calls), (Duration::ZERO, 2));
        let (out, _, calls) = renew(vec![Some(true), Some(true)]).await;
        assert!(out.is_ok());
        assert_eq!(calls, 1);
    }
}
