//! The claim: [`Engine::begin`], the engine's one entry, and what it answers.
//!
//! `begin` checks the key and the policy, counts the request in flight (so a drain either
//! waits for it or it backs out), and asks the store to claim the (scope, key) record
//! atomically: the first request gets a fresh lease ([`Begin::Claimed`]), a duplicate while it
//! runs gets [`Begin::InProgress`], a retry after it finished gets the stored outcome
//! ([`Begin::Replay`]), and a different request under the same key gets [`Begin::Mismatch`].
//! A record whose lease or ttl ran out is taken over: the new claim's token fences out the
//! old attempt's late writes (`store/fence.rs`).

use super::cache::Looked;
use super::wait::{Pause, WaitEnd, Waiting};
use super::{
    ConfigError, Engine, ExecuteRequest, Execution, Gone, InFlight, KeyRequirement, Policy,
};
use crate::key::KeyError;
use crate::observe::{self, RequestOutcome};
use crate::store::record::{RecordKey, StoredOutcome};
use crate::store::{ClaimOutcome, ClaimRequest, StoreError};
use std::sync::Arc;
use std::time::Duration;
use tracing::Instrument;

/// Why a request ran without a record.
#[derive(Debug)]
#[non_exhaustive]
pub enum Unprotected {
    /// No key on a route where it is optional.
    NoKey,
    /// The store failed and the route opted into fail-open.
    FailedOpen(StoreError),
}

/// What [`Engine::begin`] found: run the handler under an [`Execution`], or answer without
/// running it.
#[derive(Debug)]
#[non_exhaustive]
pub enum Begin {
    /// This request claimed the record: run the handler, then [`Execution::finish`].
    Claimed(Execution),
    /// A stored outcome to replay; the handler must not run.
    Replay(StoredOutcome),
    /// Another attempt is running; retry after the given time.
    InProgress {
        /// Time until the other attempt's lease runs out.
        retry_after: Duration,
    },
    /// The key was used for a different request.
    Mismatch {
        /// Whether that request is still running.
        in_progress: bool,
    },
    /// The key is missing (on a route that requires one) or malformed.
    KeyRejected(KeyError),
    /// Run the handler without a record (no key on an optional route, or fail-open).
    Unprotected(Unprotected),
    /// The store failed; the handler must not run.
    StoreUnavailable(StoreError),
    /// [`Engine::drain`] has begun: no new execution starts in this process.
    Draining,
    /// The policy's ttl or lease is out of bounds ([`Policy::check`]); nothing was claimed.
    Misconfigured(ConfigError),
}

impl Begin {
    /// The `outcome` [`crate::observe`] counts for what a claim found.
    pub(crate) fn observed_outcome(&self) -> RequestOutcome {
        match self {
            Begin::Claimed(_) => RequestOutcome::Executed,
            Begin::Replay(_) => RequestOutcome::Replayed,
            Begin::InProgress { .. } => RequestOutcome::InProgress,
            Begin::Mismatch { .. } => RequestOutcome::Mismatch,
            Begin::KeyRejected(_) => RequestOutcome::Rejected,
            Begin::StoreUnavailable(_) => RequestOutcome::StoreUnavailable,
            Begin::Unprotected(Unprotected::NoKey | Unprotected::FailedOpen(_)) => {
                RequestOutcome::Unprotected
            }
            Begin::Draining => RequestOutcome::Draining,
            Begin::Misconfigured(_) => RequestOutcome::Misconfigured,
        }
    }
}

impl Engine {
    /// Claims the request's record. On [`Begin::Claimed`] the caller runs the handler under
    /// the returned [`Execution`] and finishes it with the outcome; every other variant says
    /// how to answer without running it (except [`Begin::Unprotected`], which says to run it
    /// without a record).
    ///
    /// With a [`Policy::wait`], a request that finds its record in progress waits for that
    /// attempt's answer (woken by the store's change notifications, [`crate::store::Changes`],
    /// and looking again at a capped interval) and answers with what it then finds: the stored
    /// outcome ([`Begin::Replay`]), or the record to run under ([`Begin::Claimed`]) if the other
    /// attempt released it or its lease ran out; [`Begin::InProgress`] at the deadline, or at
    /// once past the engine's bounds ([`EngineBuilder::max_waiting`](super::EngineBuilder::max_waiting)).
    /// Dropping the future ends the wait.
    ///
    /// Traced and counted ([`crate::observe`]): a span per request, its outcome, the claim's
    /// latency, and a wait's outcome and time.
    pub async fn begin(&self, req: ExecuteRequest, policy: &Policy) -> Begin {
        self.begin_traced(req, policy, None, false).await
    }

    /// [`Engine::begin`], whose wait also ends when `gone` resolves; `looked`: the caller
    /// looked in the replay cache already ([`Engine::look`]).
    pub(crate) async fn begin_traced(
        &self,
        req: ExecuteRequest,
        policy: &Policy,
        gone: Option<Gone>,
        looked: bool,
    ) -> Begin {
        self.inner.auto_sweep.ensure(&self.inner.store);
        let span = self.span(&req, policy);
        let start = std::time::Instant::now();
        let mut begin = self
            .begin_or_gone(req, policy, gone, looked)
            .instrument(span.clone())
            .await;
        let outcome = begin.observed_outcome();
        let store = touched_store(&begin).then(|| start.elapsed());
        observe::outcome(&span, policy.route, outcome, store);
        if let Begin::Claimed(execution) = &mut begin {
            execution.observe(span);
        }
        begin
    }

    /// The span of one request ([`crate::observe`]); the record's hash is computed only when
    /// the span is enabled.
    pub(crate) fn span(&self, req: &ExecuteRequest, policy: &Policy) -> tracing::Span {
        self.span_of(&req.scope, req.key.as_ref().ok(), policy)
    }

    fn span_of(
        &self,
        scope: &crate::scope::Scope,
        key: Option<&crate::key::IdempotencyKey>,
        policy: &Policy,
    ) -> tracing::Span {
        let span = observe::span(policy.route);
        if !span.is_disabled()
            && let Some(key) = key
        {
            let hash = self.inner.log_key.hash(scope, key);
            span.record("key", hash.as_str());
        }
        span
    }

    /// The replay cache's answer to `req` ([`Begin::Replay`] or a [`Begin::Mismatch`]),
    /// traced and counted as [`Engine::begin`]'s are; the request back when the cache does
    /// not hold its record (or there is no cache). Nothing is cloned: the request's scope and
    /// key are moved into the record's key for the look and back.
    pub(crate) fn cached(
        &self,
        req: ExecuteRequest,
        policy: &Policy,
    ) -> Result<Begin, ExecuteRequest> {
        // A draining engine or a policy out of bounds is answered as `begin` answers it.
        if self.inner.cache.is_none() || self.is_draining() || policy.check().is_err() {
            return Err(req);
        }
        let ExecuteRequest {
            scope,
            key,
            fingerprint,
        } = req;
        let key = match key {
            Ok(key) => key,
            Err(e) => {
                return Err(ExecuteRequest {
                    scope,
                    key: Err(e),
                    fingerprint,
                });
            }
        };
        let record = RecordKey::new(scope, key);
        match self.look_at(&record, &fingerprint) {
            Some(begin) => {
                let span = self.span_of(&record.scope, Some(&record.key), policy);
                observe::outcome(&span, policy.route, begin.observed_outcome(), None);
                Ok(begin)
            }
            None => Err(ExecuteRequest {
                scope: record.scope,
                key: Ok(record.key),
                fingerprint,
            }),
        }
    }

    #[cfg_attr(
        not(any(feature = "sqlite", feature = "postgres", feature = "mysql")),
        allow(dead_code)
    )]
    pub(crate) async fn begin_untraced(&self, req: ExecuteRequest, policy: &Policy) -> Begin {
        self.begin_or_gone(req, policy, None, false).await
    }

    /// [`Engine::begin_untraced`], whose wait ([`Policy::wait`]) also ends when `gone`
    /// resolves (the client went away).
    pub(crate) async fn begin_or_gone(
        &self,
        req: ExecuteRequest,
        policy: &Policy,
        mut gone: Option<Gone>,
        looked: bool,
    ) -> Begin {
        let key = match req.key {
            Ok(key) => key,
            Err(KeyError::Missing) if policy.key == KeyRequirement::Optional => {
                return Begin::Unprotected(Unprotected::NoKey);
            }
            Err(e) => return Begin::KeyRejected(e),
        };
        if let Err(e) = policy.check() {
            tracing::error!(route = policy.route, error = %e, "idempotency: policy out of bounds; refused");
            return Begin::Misconfigured(e);
        }
        let key = RecordKey::new(req.scope, key);
        if !looked && let Some(found) = self.look_at(&key, &req.fingerprint) {
            return found;
        }
        let mut waiting: Option<Waiting> = None;
        loop {
            if let Some(waiting) = &mut waiting {
                waiting.mark();
                // Before each look (a record released and claimed again is a new record, unmarked),
                // bounded by the wait; a no-op write where it is marked already.
                let left = waiting.left();
                let _ = tokio::time::timeout(left, self.inner.changes().announce(&key)).await;
            }
            let begin = self.claim_once(&key, &req.fingerprint, policy).await;
            let Begin::InProgress { retry_after } = begin else {
                if let Some(waiting) = waiting {
                    waiting.end(match &begin {
                        Begin::Replay(_) => WaitEnd::Replayed,
                        Begin::Claimed(_) => WaitEnd::Ran,
                        _ => WaitEnd::Other,
                    });
                }
                return begin;
            };
            if policy.wait.is_zero() {
                return begin;
            }
            let waiter = match &mut waiting {
                Some(waiter) => waiter,
                None => match Waiting::start(&self.inner, &key, policy.wait, policy.route) {
                    // Watching from now on: one more look at once, since the record may have
                    // changed (and its notification gone out) before the watch began.
                    Some(waiter) => {
                        waiting = Some(waiter);
                        continue;
                    }
                    None => return begin,
                },
            };
            match waiter.pause(retry_after, &mut gone).await {
                Pause::Again => {}
                ended @ (Pause::Deadline | Pause::Gone) => {
                    if let Some(waiting) = waiting {
                        waiting.end(match ended {
                            Pause::Gone => WaitEnd::Gone,
                            _ => WaitEnd::TimedOut,
                        });
                    }
                    return begin;
                }
            }
        }
    }

    /// The answer the replay cache holds for `key` and `fingerprint`, if it holds the record:
    /// its outcome to a request with the record's fingerprint, a mismatch to another.
    pub(crate) fn look_at(
        &self,
        key: &RecordKey,
        fingerprint: &crate::fingerprint::Fingerprint,
    ) -> Option<Begin> {
        match self.inner.cache.as_ref()?.look(key, fingerprint) {
            Looked::Hit(outcome) => Some(Begin::Replay(outcome)),
            Looked::Mismatch => Some(Begin::Mismatch { in_progress: false }),
            Looked::Miss => None,
        }
    }

    /// One claim of `key`'s record: counted in flight while it runs (so a drain that starts
    /// meanwhile either sees it, and waits for it, or it sees the drain, and backs out).
    async fn claim_once(
        &self,
        key: &RecordKey,
        fingerprint: &crate::fingerprint::Fingerprint,
        policy: &Policy,
    ) -> Begin {
        let slot = InFlight::enter(Arc::clone(&self.inner));
        if self.is_draining() {
            return Begin::Draining;
        }
        // The store starts the lease somewhere during the claim's round trip: the half-lease
        // margin counts from before it was sent, never from its answer.
        let sent = tokio::time::Instant::now();
        let req = ClaimRequest {
            key,
            fingerprint,
            lease: policy.lease,
            ttl: policy.ttl,
            max_stored: policy.max_stored as u64,
        };
        let store = &self.inner.store;
        let claim = match &self.inner.cache {
            None => store.claim(req).await,
            // With a replay cache, a replayed record the store says the life of is kept, until
            // that life (counted from before the claim was sent) or the cache's max age ends.
            Some(cache) => {
                let since = std::time::Instant::now();
                store.claim_with_expiry(req).await.map(|(outcome, lives)| {
                    if let (ClaimOutcome::Replay(replayed), Some(lives)) = (&outcome, lives) {
                        cache.keep(
                            super::cache::Kept::Read,
                            key,
                            *fingerprint,
                            replayed.clone(),
                            since,
                            lives,
                        );
                    }
                    outcome
                })
            }
        };
        observe::store_time("claim", sent.elapsed());
        match claim {
            Ok(ClaimOutcome::Claimed(lease)) => {
                if lease.took_over {
                    observe::event(policy.route, "takeover");
                    tracing::info!(
                        route = policy.route,
                        "idempotency: took over a record whose lease or ttl had run out"
                    );
                }
                Begin::Claimed(Execution::claimed(
                    slot,
                    sent,
                    key.clone(),
                    *fingerprint,
                    lease.token,
                    *policy,
                ))
            }
            Ok(ClaimOutcome::Replay(outcome)) => Begin::Replay(outcome),
            Ok(ClaimOutcome::InProgress { retry_after }) => Begin::InProgress { retry_after },
            Ok(ClaimOutcome::Mismatch { in_progress }) => Begin::Mismatch { in_progress },
            Err(error) => {
                tracing::error!(route = policy.route, error = %error, "idempotency: claim failed");
                // A corrupt record is an answer, not an outage: a record exists (it may hold a
                // finished outcome), so the handler never runs around it.
                if policy.fail_open && !matches!(error, StoreError::Corrupt(_)) {
                    Begin::Unprotected(Unprotected::FailedOpen(error))
                } else {
                    Begin::StoreUnavailable(error)
                }
            }
        }
    }
}

/// Whether answering `begin` took a store call (for the claim latency).
fn touched_store(begin: &Begin) -> bool {
    !matches!(
        begin,
        Begin::KeyRejected(_)
            | Begin::Misconfigured(_)
            | Begin::Draining
            | Begin::Unprotected(Unprotected::NoKey)
    )
}
