//! The claim: [`Engine::begin`], the engine's one entry, and what it answers.
//!
//! `begin` checks the key and the policy, counts the request in flight (so a drain either
//! waits for it or it backs out), and asks the store to claim the (scope, key) record
//! atomically: the first request gets a fresh lease ([`Begin::Claimed`]), a duplicate while it
//! runs gets [`Begin::InProgress`], a retry after it finished gets the stored outcome
//! ([`Begin::Replay`]), and a different request under the same key gets [`Begin::Mismatch`].
//! A record whose lease or ttl ran out is taken over: the new claim's token fences out the
//! old attempt's late writes (`store/fence.rs`).

use super::{ConfigError, Engine, ExecuteRequest, Execution, InFlight, KeyRequirement, Policy};
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
    /// Traced and counted ([`crate::observe`]): a span per request, its outcome, the claim's
    /// latency.
    pub async fn begin(&self, req: ExecuteRequest, policy: &Policy) -> Begin {
        self.inner.auto_sweep.ensure(&self.inner.store);
        let span = self.span(&req, policy);
        let start = std::time::Instant::now();
        let mut begin = self
            .begin_untraced(req, policy)
            .instrument(span.clone())
            .await;
        let outcome = begin.observed_outcome();
        let store = touched_store(&begin).then(|| start.elapsed());
        if let Some(took) = store {
            observe::store_time("claim", took);
        }
        observe::outcome(&span, policy.route, outcome, store);
        if let Begin::Claimed(execution) = &mut begin {
            execution.observe(span);
        }
        begin
    }

    /// The span of one request ([`crate::observe`]); the record's hash is computed only when
    /// the span is enabled.
    pub(crate) fn span(&self, req: &ExecuteRequest, policy: &Policy) -> tracing::Span {
        let span = observe::span(policy.route);
        if !span.is_disabled()
            && let Ok(key) = &req.key
        {
            let hash = self.inner.log_key.hash(&req.scope, key);
            span.record("key", hash.as_str());
        }
        span
    }

    pub(crate) async fn begin_untraced(&self, req: ExecuteRequest, policy: &Policy) -> Begin {
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
        // Counted before the claim, so a drain that starts meanwhile either sees this request
        // (and waits for it) or this request sees the drain (and backs out).
        let slot = InFlight::enter(Arc::clone(&self.inner));
        if self.is_draining() {
            return Begin::Draining;
        }
        let key = RecordKey::new(req.scope, key);
        // The store starts the lease somewhere during the claim's round trip: the half-lease
        // margin counts from before it was sent, never from its answer.
        let sent = tokio::time::Instant::now();
        let claim = self
            .inner
            .store
            .claim(ClaimRequest {
                key: &key,
                fingerprint: &req.fingerprint,
                lease: policy.lease,
                ttl: policy.ttl,
                max_stored: policy.max_stored as u64,
            })
            .await;
        match claim {
            Ok(ClaimOutcome::Claimed(lease)) => {
                if lease.took_over {
                    observe::event(policy.route, "takeover");
                    tracing::info!(
                        route = policy.route,
                        "idempotency: took over a record whose lease or ttl had run out"
                    );
                }
                Begin::Claimed(Execution::claimed(slot, sent, key, lease.token, *policy))
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
