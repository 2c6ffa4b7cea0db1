//! The engine: claim → execute → complete/release → replay.

use crate::store::{ClaimOutcome, ClaimRequest, Store, StoreError};
use crate::{Fingerprint, IdempotencyKey, KeyError, LeaseToken, RecordKey, Scope, StoredOutcome};
use futures_util::FutureExt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

/// Default ttl: how long a finished response is replayed.
pub const DEFAULT_TTL: Duration = Duration::from_secs(24 * 3600);
/// Default lease: how long a crashed attempt blocks retries.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);

/// Whether a route requires an `Idempotency-Key`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KeyRequirement {
    /// A request without a key is refused ([`Outcome::KeyRejected`] with [`KeyError::Missing`]).
    #[default]
    Required,
    /// A request without a key runs the handler unprotected ([`Outcome::NoKey`]).
    Optional,
}

/// Per-route settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// How long a finished response is replayed (a floor).
    pub ttl: Duration,
    /// How long an attempt holds the record before a retry may take over; heartbeats extend
    /// it while the handler runs.
    pub lease: Duration,
    /// Store 5xx outcomes too (Stripe style) instead of releasing the key.
    pub store_server_errors: bool,
    /// Whether a key is required.
    pub key: KeyRequirement,
    /// Run the handler unprotected when the store fails, instead of refusing the request.
    pub fail_open: bool,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            ttl: DEFAULT_TTL,
            lease: DEFAULT_LEASE,
            store_server_errors: false,
            key: KeyRequirement::Required,
            fail_open: false,
        }
    }
}

impl Policy {
    /// Whether an outcome with `status` is stored (else the key is released).
    ///
    /// 2xx, 3xx and 4xx are stored except 408, 409, 425 and 429 (they mean "try again");
    /// 5xx only with [`Policy::store_server_errors`]; anything else (1xx, invalid) is released.
    ///
    /// ```
    /// use idempotent_core::Policy;
    /// let p = Policy::default();
    /// assert!(p.stores(201) && p.stores(404) && p.stores(302));
    /// assert!(!p.stores(409) && !p.stores(429) && !p.stores(500));
    /// ```
    pub fn stores(&self, status: u16) -> bool {
        match status {
            408 | 409 | 425 | 429 => false,
            200..=499 => true,
            500..=599 => self.store_server_errors,
            _ => false,
        }
    }
}

/// One request, as the engine sees it.
#[derive(Debug, Clone)]
pub struct ExecuteRequest {
    /// The caller.
    pub scope: Scope,
    /// The parsed `Idempotency-Key` (or why it could not be parsed).
    pub key: Result<IdempotencyKey, KeyError>,
    /// The request's fingerprint.
    pub fingerprint: Fingerprint,
}

/// What a handler produced: the value handed back to the caller and what to store.
#[derive(Debug)]
pub struct Handled<T> {
    /// Returned to the caller as [`Outcome::Executed`].
    pub value: T,
    /// Stored for replays (its status decides store vs release).
    pub record: StoredOutcome,
}

/// What became of the record after the handler ran.
#[derive(Debug)]
#[non_exhaustive]
pub enum Recorded {
    /// The outcome is stored and will be replayed.
    Stored,
    /// The outcome was not storable (5xx, 408/409/425/429): the key was released.
    Released,
    /// Writing the record failed (lost lease, store error). A retry may run the handler
    /// again once the lease has run out.
    Failed(StoreError),
}

/// The result of [`Engine::execute`].
#[derive(Debug)]
#[non_exhaustive]
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
}

/// Runs handlers at most once per (scope, key), over any [`Store`].
///
/// ```
/// use idempotent_core::*;
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let engine = Engine::new(MemoryStore::new());
/// let fp = Fingerprint::compute(&FingerprintInput {
///     method: "POST", route: "/charges", query: None, content_type: None, body: b"",
/// });
/// let request = || ExecuteRequest {
///     scope: Scope::new("acct_1").unwrap(),
///     key: IdempotencyKey::parse(b"k1"),
///     fingerprint: fp,
/// };
/// let charge = || async {
///     Handled { value: "charged", record: StoredResponse::new(201, "ch_1").into() }
/// };
/// let first = engine.execute(request(), &Policy::default(), charge).await;
/// assert!(matches!(first, Outcome::Executed { value: "charged", .. }));
/// let retry = engine.execute(request(), &Policy::default(), charge).await;
/// assert!(matches!(retry, Outcome::Replayed(_)));
/// # }
/// ```
#[derive(Clone)]
pub struct Engine {
    store: Arc<dyn Store>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").finish_non_exhaustive()
    }
}

impl Engine {
    /// An engine over `store`.
    pub fn new(store: impl Store) -> Self {
        Engine {
            store: Arc::new(store),
        }
    }

    /// An engine over a shared store.
    pub fn from_arc(store: Arc<dyn Store>) -> Self {
        Engine { store }
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// Claims the request's record and runs `handler` only if the claim succeeded.
    ///
    /// While the handler runs longer than half the lease, a heartbeat extends the lease. A
    /// storable outcome (see [`Policy::stores`]) completes the record; anything else releases
    /// it. If the handler panics, the key is released and the panic resumes; if this future is
    /// dropped mid-handler (cancellation), the key is released in the background.
    pub async fn execute<T, F, Fut>(
        &self,
        req: ExecuteRequest,
        policy: &Policy,
        handler: F,
    ) -> Outcome<T>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Handled<T>>,
    {
        let key = match req.key {
            Ok(key) => key,
            Err(KeyError::Missing) if policy.key == KeyRequirement::Optional => {
                return Outcome::NoKey(handler().await.value);
            }
            Err(e) => return Outcome::KeyRejected(e),
        };
        let key = RecordKey::new(req.scope, key);
        let claim = self
            .store
            .claim(ClaimRequest {
                key: &key,
                fingerprint: &req.fingerprint,
                lease: policy.lease,
                ttl: policy.ttl,
            })
            .await;
        let lease = match claim {
            Ok(ClaimOutcome::Claimed(lease)) => lease,
            Ok(ClaimOutcome::Replay(outcome)) => return Outcome::Replayed(outcome),
            Ok(ClaimOutcome::InProgress { retry_after }) => {
                return Outcome::InProgress { retry_after };
            }
            Ok(ClaimOutcome::Mismatch { in_progress }) => return Outcome::Mismatch { in_progress },
            Err(error) if policy.fail_open => {
                return Outcome::FailedOpen {
                    value: handler().await.value,
                    error,
                };
            }
            Err(error) => return Outcome::StoreUnavailable(error),
        };

        let mut guard = ReleaseGuard {
            store: Arc::clone(&self.store),
            key: Some(key),
            token: lease.token,
        };
        let result = run_with_heartbeat(&self.store, &guard, policy.lease, handler).await;
        let key = guard.key.take();
        let Some(key) = key else {
            // Unreachable: the key is only taken here.
            return Outcome::StoreUnavailable(StoreError::Corrupt(
                "release guard lost its key".into(),
            ));
        };
        let handled = match result {
            Ok(handled) => handled,
            Err(panic) => {
                let _ = self.store.release(&key, lease.token).await;
                std::panic::resume_unwind(panic);
            }
        };
        let recorded = if policy.stores(handled.record.status()) {
            match self
                .store
                .complete(&key, lease.token, &handled.record, policy.ttl)
                .await
            {
                Ok(()) => Recorded::Stored,
                Err(e) => Recorded::Failed(e),
            }
        } else {
            match self.store.release(&key, lease.token).await {
                Ok(()) => Recorded::Released,
                Err(e) => Recorded::Failed(e),
            }
        };
        Outcome::Executed {
            value: handled.value,
            recorded,
        }
    }
}

type PanicPayload = Box<dyn std::any::Any + Send + 'static>;

/// Runs the handler, catching panics; after half the lease, a spawned heartbeat extends the
/// lease every half lease until the handler finishes.
async fn run_with_heartbeat<T, F, Fut>(
    store: &Arc<dyn Store>,
    guard: &ReleaseGuard,
    lease: Duration,
    handler: F,
) -> Result<Handled<T>, PanicPayload>
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = Handled<T>>,
{
    let fut = AssertUnwindSafe(async move { handler().await }).catch_unwind();
    let mut fut = std::pin::pin!(fut);
    let half = lease / 2;
    tokio::select! {
        biased;
        out = &mut fut => return out,
        () = tokio::time::sleep(half) => {}
    }
    // Slow handler: heartbeat in its own task so the handler is never paused by it.
    let Some(key) = guard.key.clone() else {
        return fut.await;
    };
    let heartbeat = tokio::spawn(heartbeat(Arc::clone(store), key, guard.token, lease));
    let out = fut.await;
    heartbeat.abort();
    out
}

async fn heartbeat(store: Arc<dyn Store>, key: RecordKey, token: LeaseToken, lease: Duration) {
    let half = lease / 2;
    loop {
        match store.extend(&key, token, lease).await {
            Ok(_) => tokio::time::sleep(half).await,
            // Someone took over: stop; `complete` will report the stale lease.
            Err(StoreError::StaleLease) => return,
            // A passing store error: try again sooner, the lease still has half to run.
            Err(_) => tokio::time::sleep(half / 4).await,
        }
    }
}

/// Releases the key if the handler future is dropped before it finishes (cancellation).
struct ReleaseGuard {
    store: Arc<dyn Store>,
    key: Option<RecordKey>,
    token: LeaseToken,
}

impl Drop for ReleaseGuard {
    fn drop(&mut self) {
        let Some(key) = self.key.take() else { return };
        let store = Arc::clone(&self.store);
        let token = self.token;
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let _ = store.release(&key, token).await;
            });
        }
        // Without a runtime the lease running out frees the key instead.
    }
}
