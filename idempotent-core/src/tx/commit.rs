//! A transactional execution: from the claim (in or before the handler's transaction) to the
//! commit that stores its response with its writes, or the rollback.

use super::held::Held;
use super::transaction::{FinishError, FirstClaim, Home, ReadFirst, Transaction, TxDatabase, lock};
use super::{CommitPath, TxOptions};
use crate::engine::{
    Begin, Engine, ExecuteRequest, Execution, InFlight, KeyRequirement, NoAnswer, PanicPayload,
    Policy, Recorded,
};
use crate::key::KeyError;
use crate::observe::{self, RequestOutcome, Settled};
use crate::store::fence::LeaseToken;
use crate::store::record::{RecordKey, StoredOutcome};
use crate::store::sql::{db_error, has_sqlstate};
use crate::store::{ClaimOutcome, ClaimRequest, Store, StoreError};
use futures_util::FutureExt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tracing::Instrument;

/// What [`Engine::begin_transactional`] found.
#[derive(Debug)]
#[non_exhaustive]
pub enum TxBegin<DB: TxDatabase> {
    /// Run the handler with [`TxExecution::transaction`], then [`TxExecution::finish`].
    Run(TxExecution<DB>),
    /// Answer with this, without running the handler (never [`Begin::Claimed`] or
    /// [`Begin::Unprotected`]).
    Respond(Begin),
    /// The engine's store is not a store on `DB`: the route cannot run atomically, so it
    /// does not run (answer 500; the log names both, the client is told neither).
    WrongStore {
        /// The database the route asked for.
        wanted: &'static str,
    },
}

/// What [`TxExecution::finish`] did.
#[derive(Debug)]
#[non_exhaustive]
pub enum TxFinished {
    /// The response is stored and the handler's writes committed with it: send it.
    Committed,
    /// The response is not storable (5xx, 408/409/425/429): everything rolled back and
    /// the key was released; send the response as it is.
    RolledBack,
    /// Completing or committing failed (or the fence refused: another attempt took the
    /// record over). Nothing of this attempt is known to be committed: answer 503.
    Failed(StoreError),
    /// The handler did not give its [`Transaction`] back (it kept it past its return), so
    /// nothing could be committed: answer 500.
    Escaped,
}

/// Why [`TxExecution::run`] did not return the handler's output.
#[derive(Debug)]
#[non_exhaustive]
pub enum Halted {
    /// The handler panicked: call [`TxExecution::abort`], then resume the panic with this
    /// payload (`std::panic::resume_unwind`).
    Panicked(PanicPayload),
    /// The handler was still running after this bound (its lease, on SQLite) and was
    /// stopped: call [`TxExecution::abort`], which rolls its writes back and releases the
    /// key, and answer that nothing was done (HTTP: 503).
    OverLease(Duration),
}

/// A handler stopped at its bound ([`Halted::OverLease`]), as an error.
#[derive(Debug, thiserror::Error)]
#[error("the handler's transaction was still open after {0:?}; it was stopped and rolled back")]
pub(crate) struct OverLease(pub(crate) Duration);

enum Claim {
    /// No record (a safe method, or no key where it is optional): commit iff storable.
    /// Counted towards [`Engine::drain`] all the same (it commits at its end).
    None { _slot: InFlight },
    /// The claim row is inside the transaction.
    Single {
        slot: InFlight,
        key: RecordKey,
        token: LeaseToken,
        /// The claiming request's fingerprint (kept in a replay cache after the commit).
        fingerprint: crate::fingerprint::Fingerprint,
    },
    /// The claim committed alone; the execution keeps its lease alive.
    Two(Execution),
}

/// One transactional execution: the transaction the handler writes through, and the claim
/// whose record commits with it.
pub struct TxExecution<DB: TxDatabase> {
    store: DB::Store,
    home: Home<DB>,
    claim: Claim,
    policy: Policy,
    /// The request's span ([`crate::observe`]).
    span: tracing::Span,
}

impl<DB: TxDatabase> std::fmt::Debug for TxExecution<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let claim = match &self.claim {
            Claim::None { .. } => "none",
            Claim::Single { .. } => "single",
            Claim::Two(_) => "two",
        };
        f.debug_struct("TxExecution")
            .field("database", &DB::LABEL)
            .field("claim", &claim)
            .finish_non_exhaustive()
    }
}

impl<DB: TxDatabase> TxExecution<DB> {
    fn new(store: DB::Store, tx: Held<DB>, claim: Claim, policy: Policy) -> Self {
        TxExecution {
            store,
            home: Arc::new(Mutex::new(Some(tx))),
            claim,
            policy,
            span: tracing::Span::none(),
        }
    }

    /// Whether a record protects this execution (`false` for a safe method or a request
    /// without a key on a route where the key is optional).
    pub fn is_protected(&self) -> bool {
        !matches!(self.claim, Claim::None { .. })
    }

    /// The transaction for the handler; `None` once handed out.
    pub fn transaction(&mut self) -> Option<Transaction<DB>> {
        let tx = lock(&self.home).take()?;
        Some(Transaction {
            tx: Some(tx),
            home: Arc::clone(&self.home),
        })
    }

    /// Runs `fut` (the handler, then its response body) to completion, keeping a
    /// two-commit claim's lease alive; a panic is caught and returned (then call
    /// [`TxExecution::abort`] and resume it).
    ///
    /// On a database with no idle limit of its own ([`TxDatabase::run_bound`]: SQLite, whose
    /// open write transaction holds up every writer on the file, other executions' lease
    /// renewals included), `fut` is given the route's lease and dropped if it runs longer:
    /// then call [`TxExecution::abort`], which rolls its writes back.
    ///
    /// # Errors
    /// [`Halted::Panicked`] with the panic's payload, if `fut` panicked;
    /// [`Halted::OverLease`] if it was stopped at its bound.
    pub async fn run<F: Future>(&mut self, fut: F) -> Result<F::Output, Halted> {
        let fut = fut.instrument(self.span.clone());
        let holds_lock = matches!(self.claim, Claim::Single { .. });
        let bound = DB::run_bound(&self.store, holds_lock, self.policy.lease);
        let fut = async move {
            match bound {
                Some(bound) => tokio::time::timeout(bound, fut).await.map_err(|_| bound),
                None => Ok(fut.await),
            }
        };
        let ran = match &mut self.claim {
            Claim::Two(execution) => execution.run(fut).await,
            Claim::None { .. } | Claim::Single { .. } => AssertUnwindSafe(fut).catch_unwind().await,
        };
        match ran {
            Ok(Ok(out)) => Ok(out),
            Ok(Err(bound)) => {
                tracing::error!(
                    route = self.policy.route,
                    "idempotency: the handler's {} transaction was still open after its lease ({bound:?}), holding up every writer on the database; it is stopped and rolled back, and a retry runs again",
                    DB::LABEL
                );
                Err(Halted::OverLease(bound))
            }
            Err(panic) => Err(Halted::Panicked(panic)),
        }
    }

    /// Finishes with the handler's outcome: when the policy stores its status, completes
    /// the record inside the transaction and commits; otherwise rolls back and releases.
    pub async fn finish(self, outcome: StoredOutcome) -> TxFinished {
        let span = self.span.clone();
        let route = self.policy.route;
        let protected = self.is_protected();
        let release_failed = std::sync::atomic::AtomicBool::new(false);
        let finished = self
            .finish_untraced(outcome, &release_failed)
            .instrument(span.clone())
            .await;
        if protected {
            let settled = match &finished {
                _ if release_failed.load(std::sync::atomic::Ordering::Relaxed) => {
                    Settled::ReleaseFailed
                }
                TxFinished::Committed => Settled::Stored,
                TxFinished::RolledBack => Settled::Released,
                TxFinished::Failed(StoreError::StaleLease) => Settled::FenceRefused,
                TxFinished::Failed(_) => Settled::Failed,
                // Nothing committed; the record was released (two commits) or rolled back.
                TxFinished::Escaped => Settled::Released,
            };
            observe::settled(&span, route, settled);
        }
        finished
    }

    /// [`TxExecution::finish`]; `release_failed` is set when releasing a two-commit claim
    /// failed.
    async fn finish_untraced(
        self,
        outcome: StoredOutcome,
        release_failed: &std::sync::atomic::AtomicBool,
    ) -> TxFinished {
        let released = |recorded: Recorded| {
            if matches!(recorded, Recorded::Failed(_)) {
                release_failed.store(true, std::sync::atomic::Ordering::Relaxed);
            }
        };
        let TxExecution {
            store,
            home,
            mut claim,
            policy,
            span: _,
        } = self;
        let commit_started = std::time::Instant::now();
        let taken = lock(&home).take();
        let Some(tx) = taken else {
            // Let go of the slot: when the handler's copy is dropped, its transaction is
            // dropped (rolled back) at once instead of waiting here (on SQLite it holds the
            // write lock the release below needs).
            drop(home);
            tracing::error!(
                route = policy.route,
                "idempotency: the handler kept its transaction past its return; nothing was committed"
            );
            if let Claim::Two(execution) = claim {
                // That transaction has no commit of its own: it rolls back when dropped.
                released(execution.release().await);
            }
            return TxFinished::Escaped;
        };
        if !policy.stores(outcome.status()) {
            rollback(tx, &policy).await;
            if let Claim::Two(execution) = claim {
                released(execution.release().await);
            }
            return TxFinished::RolledBack;
        }
        // A two-commit claim's lease is kept while the complete and COMMIT are on their way,
        // as while the handler ran: until the complete has run (and locked the record), a
        // retry could take over a lease that ran out and run the handler again.
        if let Claim::Two(execution) = &mut claim {
            execution.keep_alive();
        }
        let (key, token) = match &claim {
            Claim::None { .. } => {
                let committed = bounded::<DB, _>(policy.lease, "COMMIT", async {
                    DB::commit_tx(tx).await.map_err(db_error)
                })
                .await;
                observe::store_time("commit", commit_started.elapsed());
                return match committed {
                    Ok(()) => TxFinished::Committed,
                    Err(e) => {
                        tracing::error!(route = policy.route, error = %e, "idempotency: COMMIT failed");
                        TxFinished::Failed(e)
                    }
                };
            }
            Claim::Single { key, token, .. } => (key, *token),
            Claim::Two(execution) => (execution.key(), execution.token()),
        };
        // The complete and COMMIT (one round trip on PostgreSQL), bounded as a whole.
        let finish = DB::complete_commit(&store, tx, key, token, &outcome, policy.ttl);
        let finished = match DB::finish_bound(policy.lease) {
            None => finish.await,
            Some(bound) => match tokio::time::timeout(bound, finish).await {
                Ok(done) => done,
                // The transaction was dropped with the future: its ROLLBACK is queued.
                Err(_) => Err(FinishError::Commit(StoreError::unavailable(NoAnswer {
                    what: "the complete and COMMIT",
                    bound,
                }))),
            },
        };
        observe::store_time("commit", commit_started.elapsed());
        if finished.is_ok() {
            // Waiters on this record in this process look again at once.
            self_changed(&store, key);
        }
        match finished {
            Ok(()) => {
                // Committed: only now may a replay cache keep the record. The record expires
                // no sooner than a ttl after the complete ran, which was after `commit_started`.
                let kept = match &claim {
                    Claim::Single {
                        slot,
                        key,
                        fingerprint,
                        ..
                    } => Some((&slot.engine, key, *fingerprint)),
                    Claim::Two(execution) => {
                        Some((execution.engine(), execution.key(), execution.fingerprint()))
                    }
                    Claim::None { .. } => None,
                };
                if let Some((engine, key, fingerprint)) = kept
                    && let Some(cache) = &engine.cache
                {
                    cache.keep(
                        crate::engine::cache::Kept::Own,
                        key,
                        fingerprint,
                        outcome,
                        commit_started,
                        policy.ttl,
                    );
                }
                if let Claim::Two(execution) = claim {
                    execution.settle();
                }
                TxFinished::Committed
            }
            Err(FinishError::Complete(error, tx)) => {
                rollback(tx, &policy).await;
                match (claim, &error) {
                    (Claim::Two(execution), StoreError::StaleLease) => {
                        tracing::warn!(
                            route = policy.route,
                            "idempotency: the fence refused this execution: its lease was taken over; its writes rolled back"
                        );
                        execution.settle();
                    }
                    (claim, _) if is_aborted(&error) => {
                        tracing::error!(route = policy.route, error = %error, "idempotency: a statement of the handler failed and aborted its transaction, so nothing could be stored; run statements whose failure the handler answers inside a savepoint (`tx.begin()`)");
                        if let Claim::Two(execution) = claim {
                            released(execution.release().await);
                        }
                    }
                    (Claim::Two(execution), _) => {
                        tracing::error!(route = policy.route, error = %error, "idempotency: completing the record failed; the handler's writes rolled back");
                        // Nothing committed: a retry may run again.
                        released(execution.release().await);
                    }
                    _ => {
                        tracing::error!(route = policy.route, error = %error, "idempotency: completing the record failed; everything rolled back");
                    }
                }
                TxFinished::Failed(error)
            }
            Err(FinishError::Commit(e)) => {
                // Whether COMMIT applied is unknown: leave the record as COMMIT left it (a
                // two-commit claim stays in progress until its lease ends if it did not).
                tracing::error!(
                    route = policy.route,
                    error = %e,
                    "idempotency: COMMIT failed; a retry replays if it applied, else runs again"
                );
                if let Claim::Two(execution) = claim {
                    execution.settle();
                }
                TxFinished::Failed(e)
            }
        }
    }

    /// Finishes without an outcome (a panic, a response body that failed): rolls back and
    /// releases the key.
    pub async fn abort(self) {
        let protected = self.is_protected();
        let tx = lock(&self.home).take();
        if let Some(tx) = tx {
            rollback(tx, &self.policy).await;
        }
        let mut settled = Settled::Released;
        if let Claim::Two(execution) = self.claim
            && let Recorded::Failed(_) = execution.release().await
        {
            settled = Settled::ReleaseFailed;
        }
        if protected {
            observe::settled(&self.span, self.policy.route, settled);
        }
    }
}

/// `fut` (a complete or COMMIT), given up after [`TxDatabase::finish_bound`]: a
/// connection that stopped answering (a lost network) must not hold the execution, and
/// with it [`Engine::drain`], forever. Whether a COMMIT given up on applied is unknown, as
/// for any failed COMMIT: a retry replays if it did, else runs again. The execution (and
/// the key, once the server ends the idle session) is freed; the pooled connection is
/// not, until the operating system gives up on it (sqlx's release ping has no bound).
async fn bounded<DB: TxDatabase, T>(
    lease: Duration,
    what: &'static str,
    fut: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    match DB::finish_bound(lease) {
        None => fut.await,
        Some(bound) => match tokio::time::timeout(bound, fut).await {
            Ok(done) => done,
            Err(_) => Err(StoreError::unavailable(NoAnswer { what, bound })),
        },
    }
}

/// BEGIN for a two-commit execution whose claim committed: a first attempt gets an eighth of
/// the lease (as a lease renewal's does, `crate::store::renew`); if it had no answer, a
/// second one (on another connection: the first one's is not given back to the pool before
/// it answers) within the lease. The caller keeps the lease alive meanwhile.
async fn begin_bounded<DB: TxDatabase>(
    store: &DB::Store,
    lease: Duration,
) -> Result<Held<DB>, StoreError> {
    let started = tokio::time::Instant::now();
    let first = crate::store::renew::first_attempt(lease);
    if let Ok(begun) = tokio::time::timeout(first, DB::begin_tx(store, None, None)).await {
        return begun;
    }
    tracing::warn!("idempotency: BEGIN had no answer within {first:?}; trying another connection");
    tokio::time::timeout_at(started + lease, DB::begin_tx(store, None, None))
        .await
        .unwrap_or_else(|_| {
            Err(StoreError::unavailable(NoAnswer {
                what: "BEGIN",
                bound: lease,
            }))
        })
}

/// Whether a store error is PostgreSQL's "current transaction is aborted" (SQLSTATE 25P02).
fn is_aborted(error: &StoreError) -> bool {
    has_sqlstate(error, "25P02")
}

async fn rollback<DB: TxDatabase>(tx: Held<DB>, policy: &Policy) {
    let rolled_back = bounded::<DB, _>(policy.lease, "ROLLBACK", async {
        DB::rollback_tx(tx).await.map_err(db_error)
    });
    if let Err(e) = rolled_back.await {
        // The server rolls back a transaction whose connection failed.
        tracing::warn!(route = policy.route, error = %e, "idempotency: ROLLBACK failed");
    }
}

/// A place among the requests waiting on one key, given back on drop.
struct Waiter {
    engine: Engine,
    key: RecordKey,
}

impl Waiter {
    fn join(engine: &Engine, key: &RecordKey, max: usize) -> Option<Waiter> {
        if max == 0 {
            return None;
        }
        let mut waiters = lock(&engine.inner.waiters);
        let n = waiters.entry(key.clone()).or_insert(0);
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(Waiter {
            engine: engine.clone(),
            key: key.clone(),
        })
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        let mut waiters = lock(&self.engine.inner.waiters);
        if let Some(n) = waiters.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                waiters.remove(&self.key);
            }
        }
    }
}

fn wrong_store<DB: TxDatabase>(policy: &Policy) -> TxBegin<DB> {
    tracing::error!(
        route = policy.route,
        "idempotency: this route takes a {} transaction, but the engine's store is not a {} store; its requests are answered 500 and never run non-atomically",
        DB::LABEL,
        DB::LABEL
    );
    TxBegin::WrongStore { wanted: DB::LABEL }
}

/// How long a 409 tells a request whose key is held by an open transaction to wait.
const BUSY_RETRY_AFTER: Duration = Duration::from_secs(1);

fn report(outcome: ClaimOutcome) -> Begin {
    match outcome {
        ClaimOutcome::Replay(o) => Begin::Replay(o),
        ClaimOutcome::InProgress { retry_after } => Begin::InProgress { retry_after },
        ClaimOutcome::Mismatch { in_progress } => Begin::Mismatch { in_progress },
        // Never produced by a read; a claim inside a transaction is handled by the caller.
        ClaimOutcome::Claimed(_) => {
            Begin::StoreUnavailable(StoreError::Corrupt("a read reported a claim".into()))
        }
    }
}

impl Engine {
    /// The engine's store as a store on `DB`, if it is one.
    pub fn transactional_store<DB: TxDatabase>(&self) -> Option<DB::Store> {
        self.inner
            .store
            .transactional()?
            .downcast_ref::<DB::Store>()
            .cloned()
    }

    /// Claims the request's record for a handler that writes through a transaction on
    /// `DB` (see the [module docs](crate::tx)). A request without a key on a route where
    /// it is optional runs with a transaction and no record ([`TxExecution::is_protected`]).
    /// Fail-open does not apply: the handler's transaction is on the store's database.
    pub async fn begin_transactional<DB: TxDatabase>(
        &self,
        req: ExecuteRequest,
        policy: &Policy,
        options: &TxOptions,
    ) -> TxBegin<DB> {
        self.inner.auto_sweep.ensure(&self.inner.store);
        let span = self.span(&req, policy);
        let start = std::time::Instant::now();
        let mut begin = self
            .begin_transactional_untraced::<DB>(req, policy, options)
            .instrument(span.clone())
            .await;
        let (outcome, store) = match &begin {
            TxBegin::Run(execution) if execution.is_protected() => (RequestOutcome::Executed, true),
            TxBegin::Run(_) => (RequestOutcome::Unprotected, true),
            TxBegin::Respond(b) => (
                b.observed_outcome(),
                matches!(
                    b,
                    Begin::Replay(_)
                        | Begin::InProgress { .. }
                        | Begin::Mismatch { .. }
                        | Begin::StoreUnavailable(_)
                ),
            ),
            TxBegin::WrongStore { .. } => (RequestOutcome::Misconfigured, false),
        };
        let took = store.then(|| start.elapsed());
        if let Some(took) = took {
            observe::store_time("begin", took);
        }
        observe::outcome(&span, policy.route, outcome, took);
        if let TxBegin::Run(execution) = &mut begin {
            execution.span = span;
        }
        begin
    }

    async fn begin_transactional_untraced<DB: TxDatabase>(
        &self,
        req: ExecuteRequest,
        policy: &Policy,
        options: &TxOptions,
    ) -> TxBegin<DB> {
        let Some(store) = self.transactional_store::<DB>() else {
            return wrong_store::<DB>(policy);
        };
        if matches!(req.key, Err(KeyError::Missing)) && policy.key == KeyRequirement::Optional {
            return self.begin_unprotected_on::<DB>(store, policy).await;
        }
        // Two commits wait for a duplicate's answer as plain routes do (the policy's wait: the
        // route's `wait`, else the configuration's, zero by default); single commit waits on
        // the record's row lock instead (`begin_single`, for `options.wait`).
        let wait = match options.commit {
            CommitPath::Two => policy.wait,
            CommitPath::Single => Duration::ZERO,
        };
        let policy = Policy {
            fail_open: false,
            wait,
            ..*policy
        };
        // What the complete needs must be there before any handler runs.
        if let Err(error) = DB::ready(&store).await {
            tracing::error!(route = policy.route, error = %error, "idempotency: the store is not ready for transactional executions");
            return TxBegin::Respond(Begin::StoreUnavailable(error));
        }
        match options.commit {
            CommitPath::Two => match self.begin_untraced(req, &policy).await {
                // The heartbeat holds a two-commit claim: no idle limit on the handler. BEGIN
                // runs under the execution too, so its heartbeat keeps the lease while BEGIN
                // waits (a silent pooled connection, a pool whose connections are all busy),
                // and bounded, so it never holds the request for ever.
                Begin::Claimed(mut execution) => {
                    let begun = execution
                        .run(begin_bounded::<DB>(&store, policy.lease))
                        .await;
                    match begun {
                        Ok(Ok(tx)) => {
                            TxBegin::Run(TxExecution::new(store, tx, Claim::Two(execution), policy))
                        }
                        Ok(Err(error)) => {
                            tracing::error!(route = policy.route, error = %error, "idempotency: BEGIN failed");
                            execution.release().await;
                            TxBegin::Respond(Begin::StoreUnavailable(error))
                        }
                        Err(panic) => {
                            execution.release().await;
                            std::panic::resume_unwind(panic)
                        }
                    }
                }
                other => TxBegin::Respond(other),
            },
            CommitPath::Single => self.begin_single(store, req, &policy, options).await,
        }
    }

    /// A transaction with no record, for a request the route does not protect (a safe
    /// method): commits iff the policy would store the response.
    pub async fn begin_unprotected<DB: TxDatabase>(&self, policy: &Policy) -> TxBegin<DB> {
        match self.transactional_store::<DB>() {
            Some(store) => self.begin_unprotected_on::<DB>(store, policy).await,
            None => wrong_store::<DB>(policy),
        }
    }

    async fn begin_unprotected_on<DB: TxDatabase>(
        &self,
        store: DB::Store,
        policy: &Policy,
    ) -> TxBegin<DB> {
        match DB::begin_tx(&store, None, None).await {
            Ok(tx) => {
                let claim = Claim::None {
                    _slot: InFlight::enter(Arc::clone(&self.inner)),
                };
                TxBegin::Run(TxExecution::new(store, tx, claim, *policy))
            }
            Err(error) => {
                tracing::error!(route = policy.route, error = %error, "idempotency: BEGIN failed");
                TxBegin::Respond(Begin::StoreUnavailable(error))
            }
        }
    }

    async fn begin_single<DB: TxDatabase>(
        &self,
        store: DB::Store,
        req: ExecuteRequest,
        policy: &Policy,
        options: &TxOptions,
    ) -> TxBegin<DB> {
        let key = match req.key {
            Ok(key) => key,
            Err(e) => return TxBegin::Respond(Begin::KeyRejected(e)),
        };
        if let Err(e) = policy.check() {
            tracing::error!(route = policy.route, error = %e, "idempotency: policy out of bounds; refused");
            return TxBegin::Respond(Begin::Misconfigured(e));
        }
        let slot = InFlight::enter(Arc::clone(&self.inner));
        if self.is_draining() {
            return TxBegin::Respond(Begin::Draining);
        }
        let key = RecordKey::new(req.scope, key);
        if let Some(found) = self.look_at(&key, &req.fingerprint) {
            return TxBegin::Respond(found);
        }
        let claim = ClaimRequest {
            key: &key,
            fingerprint: &req.fingerprint,
            lease: policy.lease,
            ttl: policy.ttl,
            max_stored: policy.max_stored as u64,
        };
        let unavailable = |what: &str, error: StoreError| {
            tracing::error!(route = policy.route, error = %error, "idempotency: {what} failed");
            TxBegin::Respond(Begin::StoreUnavailable(error))
        };
        // Replays (and 409s for two-commit claims, mismatches) settle here, with one
        // read-only statement and no transaction.
        // On a miss the transaction begins on the connection the read ran on.
        let mut conn = None;
        if options.read_first || DB::ALWAYS_READ_FIRST {
            let mut read_on = match DB::acquire(&store).await {
                Ok(c) => c,
                Err(error) => return unavailable("the read", error),
            };
            let since = std::time::Instant::now();
            match DB::read(&store, &mut read_on, claim).await {
                Ok(ReadFirst::Settled(outcome, lives)) => {
                    // A replay whose life the read reported is kept, as a plain claim's is.
                    if let (Some(cache), ClaimOutcome::Replay(replayed), Some(lives)) =
                        (&self.inner.cache, &outcome, lives)
                    {
                        cache.keep(
                            crate::engine::cache::Kept::Read,
                            &key,
                            req.fingerprint,
                            replayed.clone(),
                            since,
                            lives,
                        );
                    }
                    return TxBegin::Respond(report(outcome));
                }
                // No record: open the transaction and claim in it at once where the
                // database can (PostgreSQL: one round trip); whatever that could not settle
                // (the key was taken meanwhile) goes the ordinary way below.
                Ok(ReadFirst::Absent) => {
                    match DB::claim_first(&store, read_on, policy.lease, claim).await {
                        Ok(FirstClaim::Claimed(tx, token)) => {
                            let claim = Claim::Single {
                                slot,
                                token,
                                key,
                                fingerprint: req.fingerprint,
                            };
                            return TxBegin::Run(TxExecution::new(store, tx, claim, *policy));
                        }
                        Ok(FirstClaim::Fallback(read_on)) => conn = Some(read_on),
                        Err(error) => return unavailable("the claim", error),
                    }
                }
                Ok(ReadFirst::Stale | ReadFirst::Held) => conn = Some(read_on),
                Err(error) => return unavailable("the read", error),
            }
        }
        // The uncommitted claim holds the key while this transaction lives: a session
        // frozen inside it must give the key back, so it may idle a lease at most.
        let mut tx = match DB::begin_tx(&store, Some(policy.lease), conn).await {
            Ok(tx) => tx,
            Err(error) => return unavailable("BEGIN", error),
        };
        let start = tokio::time::Instant::now();
        let mut waiter = None;
        let mut backoff = Duration::from_millis(2);
        loop {
            match DB::claim_in(&store, &mut tx, claim).await {
                Ok(Some(ClaimOutcome::Claimed(lease))) => {
                    if lease.took_over {
                        observe::event(policy.route, "takeover");
                        tracing::info!(
                            route = policy.route,
                            "idempotency: took over a record whose lease or ttl had run out"
                        );
                    }
                    let claim = Claim::Single {
                        slot,
                        token: lease.token,
                        key,
                        fingerprint: req.fingerprint,
                    };
                    return TxBegin::Run(TxExecution::new(store, tx, claim, *policy));
                }
                Ok(Some(other)) => {
                    rollback(tx, policy).await;
                    return TxBegin::Respond(report(other));
                }
                Ok(None) => {
                    if waiter.is_none() {
                        waiter = Waiter::join(self, &key, options.max_waiters);
                    }
                    if waiter.is_none() || start.elapsed() + backoff > options.wait {
                        rollback(tx, policy).await;
                        return TxBegin::Respond(Begin::InProgress {
                            retry_after: BUSY_RETRY_AFTER,
                        });
                    }
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_millis(100));
                }
                Err(error) => {
                    rollback(tx, policy).await;
                    return unavailable("the claim", error);
                }
            }
        }
    }
}

/// Wakes the waiters on `key` in this process (the record was just committed).
fn self_changed(store: &impl Store, key: &RecordKey) {
    if let Some(changes) = store.changes() {
        changes.notify_key(key);
    }
}
