//! Claim, run, record in one call, for the suites that exercise the engine rather than an
//! adapter. The engine's one entry is [`Engine::begin`]; this is that entry driven to its end
//! the way a queue consumer would: run the handler only on a claim, store or release after it,
//! release and resume on a panic. (It was `Engine::execute` before 0.1 closed the API: nothing
//! but tests and benches called it.)

use idempotent_core::Engine;
use idempotent_core::StoreError;
use idempotent_core::engine::{Begin, ExecuteRequest, Policy, Recorded, Unprotected};
use idempotent_core::store::StoredOutcome;
use idempotent_core::{ConfigError, KeyError};
use std::time::Duration;

/// What a handler produced: the value handed back to the caller and what to store.
#[derive(Debug)]
pub struct Handled<T> {
    /// Returned to the caller as [`Outcome::Executed`].
    pub value: T,
    /// Stored for replays (its status decides store vs release).
    pub record: StoredOutcome,
}

/// What [`Execute::execute`] did: one variant per [`Begin`] answer, with the handler's value
/// where it ran.
#[derive(Debug)]
pub enum Outcome<T> {
    /// The handler ran (this request won the claim).
    Executed {
        /// The handler's value.
        value: T,
        /// What became of the record.
        recorded: Recorded,
    },
    /// A stored outcome to replay; the handler did not run.
    Replayed(StoredOutcome),
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
    /// The store failed; the handler did not run.
    StoreUnavailable(StoreError),
    /// No key on a route where it is optional: the handler ran unprotected.
    NoKey(T),
    /// The store failed and the route opted into fail-open: the handler ran unprotected.
    FailedOpen {
        /// The handler's value.
        value: T,
        /// The store's error.
        error: StoreError,
    },
    /// The engine is draining (shutting down); the handler did not run.
    Draining,
    /// The policy is out of bounds; the handler did not run.
    Misconfigured(ConfigError),
}

/// [`Engine::begin`] driven to its end.
pub trait Execute {
    /// Claims the request's record and runs `handler` only if the claim succeeded; a storable
    /// outcome is stored, anything else releases the key. A panic releases the key and
    /// resumes. If this future is dropped while the handler runs, the record stays in progress
    /// until its lease runs out.
    fn execute<T, F, Fut>(
        &self,
        req: ExecuteRequest,
        policy: &Policy,
        handler: F,
    ) -> impl Future<Output = Outcome<T>>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Handled<T>>;
}

impl Execute for Engine {
    async fn execute<T, F, Fut>(
        &self,
        req: ExecuteRequest,
        policy: &Policy,
        handler: F,
    ) -> Outcome<T>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Handled<T>>,
    {
        match self.begin(req, policy).await {
            Begin::Claimed(mut execution) => match execution.run(handler()).await {
                Ok(handled) => Outcome::Executed {
                    recorded: execution.finish(handled.record).await,
                    value: handled.value,
                },
                Err(panic) => {
                    execution.release().await;
                    std::panic::resume_unwind(panic)
                }
            },
            Begin::Replay(outcome) => Outcome::Replayed(outcome),
            Begin::InProgress { retry_after } => Outcome::InProgress { retry_after },
            Begin::Mismatch { in_progress } => Outcome::Mismatch { in_progress },
            Begin::KeyRejected(e) => Outcome::KeyRejected(e),
            Begin::Unprotected(Unprotected::NoKey) => Outcome::NoKey(handler().await.value),
            Begin::Unprotected(Unprotected::FailedOpen(error)) => Outcome::FailedOpen {
                value: handler().await.value,
                error,
            },
            Begin::StoreUnavailable(e) => Outcome::StoreUnavailable(e),
            Begin::Draining => Outcome::Draining,
            Begin::Misconfigured(e) => Outcome::Misconfigured(e),
            other => panic!("an answer this fixture does not know: {other:?}"),
        }
    }
}
