//! The real [`Engine`] under deterministic simulation, on the memory store and on SQLite,
//! each request served either on the engine's API or through the HTTP driver both adapters
//! share (`__private::driver`, with the smallest framework glue).
//!
//! Each seed builds one world: two servers (two engines over one store, as two instances
//! share a database), clients retrying a few keys, and a store wrapper that, drawn from the
//! seed, delays every operation, fails it before it applies, loses its answer after it
//! applied, and jumps the store's clock forward (past leases, as a paused VM or a frozen
//! process sees it). Servers crash (every task they run is dropped mid-step, kill -9 style)
//! and come back; clients time out and retry while the first attempt runs on. Everything runs
//! on one tokio thread with a paused clock, so a seed is one schedule: a failing seed
//! reproduces by number (`SIM_SEED=n`).
//!
//! The invariants are those of the model (`tests/src/model.rs`), checked against a log the
//! wrapper and the handlers keep:
//! - a stored response never changes (no second complete lands; the store's record at the end
//!   holds the first stored response), and it is byte for byte a response a handler produced;
//! - every replay equals the stored response, and every first execution's answer is what its
//!   handler produced;
//! - a complete, release or extend under a token that no longer holds the record never lands;
//! - a take-over happens only after the lease the store last granted ran out on its clock, and
//!   a running owner's lease runs out only through a clock jump or a failed extend (its
//!   heartbeat keeps it otherwise);
//! - two executions of one key overlap, and an execution starts after a response is stored,
//!   only where an execution lost its lease while it held it (the frozen owner plain mode
//!   admits; SECURITY.md).
//!
//! SQLite's store reads its time from a clock table the simulation sets before every
//! operation (`SqliteStoreBuilder::clock_sql`, a hidden test hook), so its leases run out on
//! the simulated clock, jumps included, to the millisecond; its operations run to completion on
//! a helper thread while the simulated world waits (so no simulated time passes during one).
//!
//! The silent-connection arm adds hangs: a renewal, complete or release that never answers
//! (before it applies, or after), as on a pooled connection that went silent. The engine must
//! give up on it within its bound and try again on a connection opened for the retry (here: a
//! write the engine marks with `store::wants_fresh_connection` never hangs, and any other may),
//! so a running owner still keeps its lease: a hang never excuses a lease that ran out.
//!
//! Environment: `SIM_SEED=n` runs seed n alone (printing its log); `SIM_SEEDS=n` sets how
//! many seeds each arm runs (default 5,000 on memory, 1,000 on SQLite) from `SIM_SEED_BASE`
//! (default 0), within `SIM_BUDGET_SECS` of wall time per arm (default 20).

use bytes::Bytes;
use idempotent_core::__private::driver::{self, Glue};
use idempotent_core::__private::{FIRST_EXECUTION, Recorder, Reply, RequestHead, Route, RouteArgs};
use idempotent_core::clock::Clock;
use idempotent_core::engine::KeyRequirement;
use idempotent_core::engine::{Begin, ExecuteRequest, Policy};
use idempotent_core::fingerprint::{Fingerprint, FingerprintInput};
use idempotent_core::http::{Config, IDEMPOTENT_REPLAYED};
use idempotent_core::store::{
    ClaimOutcome, ClaimRequest, Deleted, LeaseToken, Record, RecordKey, RecordState, StoredOutcome,
    StoredResponse,
};
use idempotent_core::{Engine, IdempotencyKey, MemoryStore, Scope, Store, StoreError};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime};
use tokio::task::JoinSet;

const SERVERS: usize = 2;
const CLIENTS: usize = 4;
const KEYS: usize = 2;
const ATTEMPTS: usize = 8;
const LEASE: Duration = Duration::from_secs(2);
/// The longest delay put before or after a store operation (exclusive).
const MAX_DELAY_MS: u64 = 400;
// The heartbeat check holds only while an extend lands within a lease of the one before: the
// engine extends half a lease after the last answer, and each extend may wait a delay before
// it applies and another before its answer.
const _: () = assert!(2 * MAX_DELAY_MS + LEASE.as_millis() as u64 / 2 < LEASE.as_millis() as u64);
const TTL: Duration = Duration::from_secs(24 * 3600);
/// Wall-clock budget per arm: seeds stop there even if fewer than asked have run.
const BUDGET: Duration = Duration::from_secs(20);

/// Which store the world runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Arm {
    Memory,
    #[cfg(feature = "sqlite")]
    Sqlite,
    /// The memory store, with writes after the claim that can hang (silent connections).
    Silent,
}

/// The longest delay before and after a store operation in the silent-connection arm: a
/// renewal whose first attempt hangs is tried again an eighth of a lease later, so it lands
/// within the lease only while two delays and five eighths of a lease fit in one.
const SILENT_MAX_DELAY_MS: u64 = 300;
const _: () =
    assert!(2 * SILENT_MAX_DELAY_MS + LEASE.as_millis() as u64 * 5 / 8 < LEASE.as_millis() as u64);

/// Fault rates, drawn once per seed so some seeds are calm and some are storms.
#[derive(Debug, Clone, Copy)]
struct Faults {
    /// Longest delay before and after a store operation.
    max_delay_ms: u64,
    /// An operation fails before it applies.
    error: f64,
    /// An operation applies and its answer is lost.
    lost: f64,
    /// Per client step: a server crashes.
    crash: f64,
    /// Per store operation: the store's clock jumps forward past a lease.
    jump: f64,
    /// Per extend, complete or release: it never answers (before it applies or after),
    /// unless the engine asked for a fresh connection for it.
    hang: f64,
}

/// What the world saw, for the invariants and for the report.
#[derive(Debug, Default)]
struct Log {
    /// Every event, in order (two runs of one seed must produce the same list).
    events: Vec<String>,
    violations: Vec<String>,
    /// The token of the latest claim the store granted, per key (lost answers included).
    latest: HashMap<usize, LeaseToken>,
    /// The first response stored, per key.
    stored: HashMap<usize, (u16, Vec<u8>)>,
    /// Claims answered to a server whose execution has not ended, per key: (token, server).
    holders: HashMap<usize, Vec<(LeaseToken, usize)>>,
    /// Executions running now, per key: (execution, token, server).
    live: HashMap<usize, Vec<(u32, LeaseToken, usize)>>,
    /// Tokens whose holder lost the lease to a take-over while it still held it (frozen past
    /// its lease, or its claim's answer slower than the lease).
    lost_while_held: HashSet<LeaseToken>,
    /// Per token: when its lease ends on the store's clock (set by the claim and every extend
    /// that applied), and whether its holder may have let it run out (a clock jump, or an
    /// extend that failed or whose answer was lost, since its last renewal).
    leases: HashMap<LeaseToken, (Duration, bool)>,
    /// Every response a handler produced: (status, body).
    produced: HashSet<(u16, Vec<u8>)>,
    /// Fenced writes the store refused (a stale owner's complete, release or extend).
    refused: u32,
    executions: u32,
    replays: u32,
    /// Replays answered through the HTTP driver.
    http_replays: u32,
    crashes: u32,
    lost: u32,
    errors: u32,
    jumps: u32,
    live_takeovers: u32,
    /// Writes that never answered (the silent-connection arm).
    hangs: u32,
    /// When the first event happened (simulated time), for the events' times.
    origin: Option<tokio::time::Instant>,
}

impl Log {
    fn event(&mut self, e: String) {
        let origin = *self.origin.get_or_insert_with(tokio::time::Instant::now);
        let ms = origin.elapsed().as_millis();
        self.events.push(format!("[{ms:>6} ms] {e}"));
    }
    fn violation(&mut self, v: String) {
        self.events.push(format!("VIOLATION {v}"));
        self.violations.push(v);
    }
}

/// The world's shared state: its random source, fault rates, log and store clock.
struct World {
    rng: Mutex<StdRng>,
    faults: Faults,
    log: Mutex<Log>,
}

impl World {
    fn draw<T>(&self, f: impl FnOnce(&mut StdRng) -> T) -> T {
        f(&mut self.rng.lock().expect("rng"))
    }
    fn chance(&self, p: f64) -> bool {
        p > 0.0 && self.draw(|r| r.random_bool(p))
    }
    fn log(&self) -> std::sync::MutexGuard<'_, Log> {
        self.log.lock().expect("log")
    }
    async fn delay(&self) {
        let ms = self.draw(|r| r.random_range(0..=self.faults.max_delay_ms));
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
}

/// The memory store's clock: the simulated (paused) tokio clock, plus the jumps.
#[derive(Debug)]
struct SimClock(Arc<WorldClock>);

#[derive(Debug)]
struct WorldClock {
    origin: tokio::time::Instant,
    jumped: Mutex<Duration>,
}

impl Clock for SimClock {
    fn now(&self) -> SystemTime {
        SystemTime::UNIX_EPOCH
            + Duration::from_secs(1_800_000_000)
            + self.0.origin.elapsed()
            + *self.0.jumped.lock().expect("clock")
    }
    fn instant(&self) -> Instant {
        tokio::time::Instant::now().into_std() + *self.0.jumped.lock().expect("clock")
    }
}

/// Runs store operations: in place (memory), or to completion on a helper runtime while
/// the simulated world waits (SQLite, whose I/O would otherwise let the paused clock run).
enum Runner {
    Direct,
    #[cfg(feature = "sqlite")]
    Blocking,
}

/// The helper runtime SQLite's operations run on.
#[cfg(feature = "sqlite")]
fn helper() -> &'static tokio::runtime::Runtime {
    static HELPER: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    HELPER.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("helper runtime")
    })
}

impl Runner {
    async fn run<T, Fut>(&self, fut: Fut) -> T
    where
        T: Send + 'static,
        Fut: Future<Output = T> + Send + 'static,
    {
        match self {
            Runner::Direct => fut.await,
            #[cfg(feature = "sqlite")]
            Runner::Blocking => {
                let (tx, rx) = std::sync::mpsc::channel();
                helper().spawn(async move {
                    let _ = tx.send(fut.await);
                });
                rx.recv().expect("the helper runtime answers")
            }
        }
    }
}

tokio::task_local! {
    /// The request a task serves: its server, and the token its claim got.
    static REQUEST: (usize, Cell<Option<LeaseToken>>);
}

/// The store every server shares, with the seed's faults put in, keeping the log.
struct SimStore {
    inner: Arc<dyn Store>,
    world: Arc<World>,
    runner: Runner,
    clock: Arc<WorldClock>,
    #[cfg(feature = "sqlite")]
    sqlite: Option<idempotent_core::SqliteStore>,
}

/// The wall time the simulated clocks start at, in ms since the Unix epoch.
const EPOCH_MS: u128 = 1_800_000_000_000;

fn key_index(key: &RecordKey) -> usize {
    key.key.as_str()[1..].parse().expect("keys are k<n>")
}

fn unavailable(why: &str) -> StoreError {
    StoreError::unavailable(std::io::Error::other(why.to_owned()))
}

impl SimStore {
    /// The store's clock, as time since the world began: the simulated time plus the jumps.
    fn store_now(&self) -> Duration {
        self.clock.origin.elapsed() + *self.clock.jumped.lock().expect("clock")
    }

    /// A lease that applied: `token`'s lease now ends `lease` from the store's now.
    fn renewed(&self, token: LeaseToken, lease: Duration) {
        let end = self.store_now() + lease;
        self.world.log().leases.insert(token, (end, false));
    }

    /// `token`'s holder may have let its lease run out, through no fault of the heartbeat.
    fn excuse(&self, token: LeaseToken) {
        if let Some((_, excused)) = self.world.log().leases.get_mut(&token) {
            *excused = true;
        }
    }

    /// SQLite reads its time from the simulation (`SqliteStoreBuilder::clock_sql`): before
    /// each operation the clock table is set to the store's now, so SQLite's leases run out
    /// on the simulated clock exactly as the memory store's do.
    async fn follow_the_clock(&self) {
        #[cfg(feature = "sqlite")]
        if let Some(store) = &self.sqlite {
            let ms = EPOCH_MS + self.store_now().as_millis();
            let pool = store.pool().clone();
            self.runner
                .run(async move {
                    sqlx::query("UPDATE sim_clock SET ms = ?1")
                        .bind(ms as i64)
                        .execute(&pool)
                        .await
                })
                .await
                .expect("set the simulated clock");
        }
    }

    /// The faults before an operation: a delay, maybe a clock jump, maybe a failure.
    async fn before(&self, op: &str, key: Option<usize>) -> Result<(), StoreError> {
        self.world.delay().await;
        if self.world.chance(self.world.faults.jump) {
            self.jump().await;
        }
        self.follow_the_clock().await;
        if self.world.chance(self.world.faults.error) {
            let mut log = self.world.log();
            log.errors += 1;
            log.event(format!("{op} {key:?}: failed before applying"));
            return Err(unavailable("injected failure"));
        }
        Ok(())
    }

    /// A write may hang here, never answering (its future is dropped by the engine's bound on
    /// it), unless the engine asked for a fresh connection for it (a retry after a write it
    /// gave up on): a connection opened for it is not the one that went silent.
    async fn hang(&self, op: &str, key: usize, applied: bool) {
        if idempotent_core::store::wants_fresh_connection() {
            return;
        }
        {
            if !self.world.chance(self.world.faults.hang) {
                return;
            }
            let mut log = self.world.log();
            log.hangs += 1;
            let when = if applied {
                "after it applied"
            } else {
                "before it applied"
            };
            log.event(format!("{op} k{key}: hangs {when}"));
        }
        std::future::pending::<()>().await;
    }

    /// The faults after an operation applied: a delay, maybe a lost answer.
    async fn after<T>(
        &self,
        op: &str,
        key: usize,
        out: Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        self.world.delay().await;
        if out.is_ok() && self.world.chance(self.world.faults.lost) {
            let mut log = self.world.log();
            log.lost += 1;
            log.event(format!("{op} k{key}: applied, answer lost"));
            return Err(unavailable("injected lost answer"));
        }
        out
    }

    /// The store's clock jumps forward past a lease.
    async fn jump(&self) {
        // Past a whole lease, so every lease running then has run out.
        let by = LEASE + Duration::from_millis(self.world.draw(|r| r.random_range(100..=2000)));
        {
            let mut log = self.world.log();
            log.jumps += 1;
            log.event(format!("clock jumps {by:?}"));
            // Every lease may run out now, heartbeat or not.
            for (_, excused) in log.leases.values_mut() {
                *excused = true;
            }
        }
        // SQLite reads it from the clock table, set before every operation.
        *self.clock.jumped.lock().expect("clock") += by;
    }

    /// Counts a fenced write the store refused, when it came from a lease that was taken over
    /// (not the owner's own retry after a lost answer, or a heartbeat after its complete).
    fn refused(&self, key: usize, token: LeaseToken) {
        let mut log = self.world.log();
        if log.latest.get(&key) != Some(&token) {
            log.refused += 1;
        }
    }

    /// Checks a fenced write that the store accepted.
    fn landed(&self, op: &str, key: usize, token: LeaseToken) {
        let mut log = self.world.log();
        log.event(format!("{op} k{key}: landed"));
        if log.latest.get(&key) != Some(&token) {
            log.violation(format!(
                "{op} k{key} landed under a token that no longer holds the record"
            ));
        }
    }
}

#[async_trait::async_trait]
impl Store for SimStore {
    async fn claim(&self, req: ClaimRequest<'_>) -> Result<ClaimOutcome, StoreError> {
        let k = key_index(req.key);
        self.before("claim", Some(k)).await?;
        let inner = Arc::clone(&self.inner);
        let (key, fingerprint) = (req.key.clone(), *req.fingerprint);
        let (lease, ttl, max_stored) = (req.lease, req.ttl, req.max_stored);
        let out = self
            .runner
            .run(async move {
                inner
                    .claim(ClaimRequest {
                        key: &key,
                        fingerprint: &fingerprint,
                        lease,
                        ttl,
                        max_stored,
                    })
                    .await
            })
            .await;
        {
            let mut log = self.world.log();
            match &out {
                Ok(ClaimOutcome::Claimed(granted)) => {
                    let previous = log.latest.insert(k, granted.token);
                    if granted.took_over {
                        // The lease taken over must have run out on the store's clock; and if
                        // its holder still runs, something must explain how it ran out.
                        let now = self.store_now();
                        let lease_end = previous.and_then(|p| log.leases.get(&p).copied());
                        let holder_runs = previous.is_some_and(|p| {
                            log.holders
                                .get(&k)
                                .is_some_and(|h| h.iter().any(|(t, _)| *t == p))
                        });
                        match lease_end {
                            Some((end, _)) if now < end => log.violation(format!(
                                "k{k}: a lease was taken over {:?} before it ran out",
                                end - now
                            )),
                            Some((_, false)) if holder_runs => log.violation(format!(
                                "k{k}: a running execution's lease ran out with no jump and no failed extend (its heartbeat)"
                            )),
                            _ => {}
                        }
                    }
                    log.leases
                        .insert(granted.token, (self.store_now() + lease, false));
                    let lease = granted;
                    let held: Vec<LeaseToken> = log
                        .holders
                        .get(&k)
                        .map(|h| h.iter().map(|(t, _)| *t).collect())
                        .unwrap_or_default();
                    if lease.took_over && !held.is_empty() {
                        log.live_takeovers += 1;
                        log.lost_while_held.extend(held);
                    }
                    // The server holds the lease from here (its answer on the way) until its
                    // execution ends, unless the answer is lost.
                    if let Ok(server) = REQUEST.try_with(|(server, _)| *server) {
                        log.holders
                            .entry(k)
                            .or_default()
                            .push((lease.token, server));
                    }
                    log.event(format!(
                        "claim k{k}: claimed (took over: {})",
                        lease.took_over
                    ));
                }
                Ok(other) => log.event(format!("claim k{k}: {}", outcome_name(other))),
                Err(e) => log.event(format!("claim k{k}: error {e}")),
            }
        }
        let granted = match &out {
            Ok(ClaimOutcome::Claimed(lease)) => Some(lease.token),
            _ => None,
        };
        let out = self.after("claim", k, out).await;
        if let Some(token) = granted {
            if out.is_ok() {
                let _ = REQUEST.try_with(|(_, claimed)| claimed.set(Some(token)));
            } else if let Some(holders) = self.world.log().holders.get_mut(&k) {
                // Lost: no execution starts from this claim.
                holders.retain(|(t, _)| *t != token);
            }
        }
        out
    }

    async fn complete(
        &self,
        key: &RecordKey,
        token: LeaseToken,
        outcome: &StoredOutcome,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        self.complete_op(key, token, outcome, ttl).await
    }

    async fn release(&self, key: &RecordKey, token: LeaseToken) -> Result<(), StoreError> {
        self.release_op(key, token).await
    }

    async fn extend(
        &self,
        key: &RecordKey,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<SystemTime, StoreError> {
        self.extend_op(key, token, lease).await
    }

    async fn purge_expired(&self, batch: usize) -> Result<u64, StoreError> {
        self.before("purge", None).await?;
        let inner = Arc::clone(&self.inner);
        self.runner
            .run(async move { inner.purge_expired(batch).await })
            .await
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        self.follow_the_clock().await;
        let (inner, key) = (Arc::clone(&self.inner), key.clone());
        self.runner.run(async move { inner.get(&key).await }).await
    }

    async fn delete(&self, key: &RecordKey, force: bool) -> Result<Deleted, StoreError> {
        self.follow_the_clock().await;
        let (inner, key) = (Arc::clone(&self.inner), key.clone());
        self.runner
            .run(async move { inner.delete(&key, force).await })
            .await
    }
}

/// The faulty operations behind the store's writes.
impl SimStore {
    async fn complete_op(
        &self,
        key: &RecordKey,
        token: LeaseToken,
        outcome: &StoredOutcome,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let k = key_index(key);
        self.before("complete", Some(k)).await?;
        let applied = self.world.faults.hang > 0.0 && self.world.chance(0.5);
        if !applied {
            self.hang("complete", k, false).await;
        }
        let (inner, key, stored) = (Arc::clone(&self.inner), key.clone(), outcome.clone());
        let out = self
            .runner
            .run(async move { inner.complete(&key, token, &stored, ttl).await })
            .await;
        if matches!(out, Err(StoreError::StaleLease)) {
            self.refused(k, token);
        }
        if out.is_ok() {
            self.landed("complete", k, token);
            let response = response_of(outcome);
            let mut log = self.world.log();
            if !log.produced.contains(&response) {
                log.violation(format!(
                    "k{k}: the stored response is not what the handler answered: {response:?}"
                ));
            }
            if let std::collections::hash_map::Entry::Vacant(first) = log.stored.entry(k) {
                first.insert(response);
            } else {
                log.violation(format!("a second response was stored for k{k}"));
            }
        }
        if applied {
            self.hang("complete", k, true).await;
        }
        self.after("complete", k, out).await
    }

    async fn release_op(&self, key: &RecordKey, token: LeaseToken) -> Result<(), StoreError> {
        let k = key_index(key);
        self.before("release", Some(k)).await?;
        let applied = self.world.faults.hang > 0.0 && self.world.chance(0.5);
        if !applied {
            self.hang("release", k, false).await;
        }
        let (inner, key) = (Arc::clone(&self.inner), key.clone());
        let out = self
            .runner
            .run(async move { inner.release(&key, token).await })
            .await;
        if matches!(out, Err(StoreError::StaleLease)) {
            self.refused(k, token);
        }
        if out.is_ok() {
            self.landed("release", k, token);
            let mut log = self.world.log();
            if log.stored.contains_key(&k) {
                log.violation(format!("a stored response was released for k{k}"));
            }
        }
        if applied {
            self.hang("release", k, true).await;
        }
        self.after("release", k, out).await
    }

    async fn extend_op(
        &self,
        key: &RecordKey,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<SystemTime, StoreError> {
        let k = key_index(key);
        if let Err(e) = self.before("extend", Some(k)).await {
            self.excuse(token);
            return Err(e);
        }
        let applied = self.world.faults.hang > 0.0 && self.world.chance(0.5);
        if !applied {
            self.hang("extend", k, false).await;
        }
        let (inner, key) = (Arc::clone(&self.inner), key.clone());
        let out = self
            .runner
            .run(async move { inner.extend(&key, token, lease).await })
            .await;
        match &out {
            Ok(_) => {
                self.landed("extend", k, token);
                self.renewed(token, lease);
            }
            Err(StoreError::StaleLease) => self.refused(k, token),
            Err(_) => {}
        }
        if applied {
            self.hang("extend", k, true).await;
        }
        let out = self.after("extend", k, out).await;
        if out.is_err() {
            // The engine saw a failed extend: its lease may run out before the next.
            self.excuse(token);
        }
        out
    }
}

fn outcome_name(o: &ClaimOutcome) -> &'static str {
    match o {
        ClaimOutcome::Claimed(_) => "claimed",
        ClaimOutcome::Replay(_) => "replay",
        ClaimOutcome::InProgress { .. } => "in progress",
        ClaimOutcome::Mismatch { .. } => "mismatch",
    }
}

/// A stored outcome's status and body.
fn response_of(outcome: &StoredOutcome) -> (u16, Vec<u8>) {
    match outcome {
        StoredOutcome::Response(r) => (r.status, r.body.to_vec()),
        StoredOutcome::Oversized { status, .. } => (*status, b"oversized".to_vec()),
    }
}

/// A running execution, in the log until it ends or its server crashes (dropped).
struct Running {
    world: Arc<World>,
    key: usize,
    exec: u32,
    token: LeaseToken,
}

impl Log {
    /// An execution is no longer running, and no longer holds its lease.
    fn ended(&mut self, key: usize, exec: u32, token: LeaseToken) {
        if let Some(live) = self.live.get_mut(&key) {
            live.retain(|(e, _, _)| *e != exec);
        }
        if let Some(holders) = self.holders.get_mut(&key) {
            holders.retain(|(t, _)| *t != token);
        }
    }

    /// `server` crashed: what it ran and held stopped there and then.
    fn crashed(&mut self, server: usize) {
        for live in self.live.values_mut() {
            live.retain(|(_, _, s)| *s != server);
        }
        for holders in self.holders.values_mut() {
            holders.retain(|(_, s)| *s != server);
        }
    }
}

impl Running {
    fn start(world: &Arc<World>, key: usize, server: usize, token: LeaseToken) -> Self {
        let mut log = world.log();
        log.executions += 1;
        let exec = log.executions;
        log.event(format!("execution {exec} of k{key} starts"));
        // Only an owner whose lease was taken over while it held it (frozen between its claim
        // and its handler) can start after a response was stored.
        if log.stored.contains_key(&key) && !log.lost_while_held.contains(&token) {
            log.violation(format!(
                "execution {exec} of k{key} started after a response was stored, holding its lease"
            ));
        }
        // Two executions may overlap only where one of them lost its lease while it held it.
        let unexplained: Vec<u32> = log
            .live
            .get(&key)
            .into_iter()
            .flatten()
            .filter(|(_, other, _)| {
                !log.lost_while_held.contains(other) && !log.lost_while_held.contains(&token)
            })
            .map(|(e, _, _)| *e)
            .collect();
        if !unexplained.is_empty() {
            log.violation(format!(
                "execution {exec} of k{key} overlaps {unexplained:?}, and neither lost its lease"
            ));
        }
        log.live.entry(key).or_default().push((exec, token, server));
        Running {
            world: Arc::clone(world),
            key,
            exec,
            token,
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let mut log = self.world.log();
        log.ended(self.key, self.exec, self.token);
        log.event(format!("execution {} of k{} ends", self.exec, self.key));
    }
}

/// One server: an engine, its HTTP configuration, and the tasks it runs (dropped together
/// when it crashes).
struct Server {
    engine: Engine,
    config: Config,
    tasks: JoinSet<()>,
}

impl Server {
    fn start(store: &Arc<SimStore>) -> Self {
        let engine = engine(store);
        Server {
            config: Config::new(engine.clone()),
            engine,
            tasks: JoinSet::new(),
        }
    }
}

fn engine(store: &Arc<SimStore>) -> Engine {
    Engine::builder_from_arc(Arc::clone(store) as Arc<dyn Store>)
        .lease(LEASE)
        .build()
        .expect("engine")
}

fn request(key: usize) -> ExecuteRequest {
    ExecuteRequest {
        scope: Scope::new("acct_sim").expect("scope"),
        key: IdempotencyKey::parse(format!("k{key}").as_bytes()),
        fingerprint: Fingerprint::compute(&FingerprintInput {
            method: "POST",
            path: "/charges",
            query: None,
            content_type: None,
            body: b"{}",
        }),
    }
}

/// The simulated route, as `#[idempotent(ttl = "24h", lease = "2s")]` declares it.
static ROUTE: Route = Route::new(RouteArgs {
    name: "sim",
    ttl: Some(TTL),
    lease: Some(LEASE),
    key: KeyRequirement::Required,
    store_server_errors: false,
    max_response: None,
});

/// A response on plain types, for the HTTP driver.
struct SimResponse {
    head: (u16, Vec<(String, Vec<u8>)>),
    body: Bytes,
}

/// The smallest framework glue: the driver's lifecycle over [`SimResponse`].
struct SimGlue;

impl Glue for SimGlue {
    type Response = SimResponse;
    type Head = (u16, Vec<(String, Vec<u8>)>);
    type Body = Bytes;
    type Error = std::convert::Infallible;

    fn reply(reply: Reply) -> SimResponse {
        SimResponse {
            head: (
                reply.status,
                reply
                    .headers
                    .into_iter()
                    .map(|(n, v)| (n.into_owned(), v.into_owned()))
                    .collect(),
            ),
            body: reply.body.into(),
        }
    }
    fn split(response: SimResponse) -> (Self::Head, Bytes) {
        (response.head, response.body)
    }
    fn join(head: Self::Head, body: Bytes) -> SimResponse {
        SimResponse { head, body }
    }
    fn status(head: &Self::Head) -> u16 {
        head.0
    }
    fn headers(head: &Self::Head) -> impl Iterator<Item = (&str, &[u8])> {
        head.1.iter().map(|(n, v)| (n.as_str(), v.as_slice()))
    }
    fn mark_first_execution(head: &mut Self::Head) {
        head.1.push((
            FIRST_EXECUTION.0.to_owned(),
            FIRST_EXECUTION.1.as_bytes().to_vec(),
        ));
    }
    fn exact_len(body: &Bytes) -> Option<u64> {
        Some(body.len() as u64)
    }
    fn collect(body: Bytes) -> impl Future<Output = Result<Bytes, Self::Error>> {
        std::future::ready(Ok(body))
    }
    fn from_bytes(bytes: Bytes) -> Bytes {
        bytes
    }
    fn tee(_: Bytes, _: Recorder) -> Bytes {
        unreachable!("every body here has a known length, so the driver collects it")
    }
}

/// What a client is told.
#[derive(Debug)]
enum Answer {
    Fresh(Vec<u8>),
    Replay(Vec<u8>),
    Retry,
}

/// The simulated handler: runs for a drawn time, answers 201 (or, one time in ten, 500, which
/// releases the key) with a body naming its execution.
async fn handler(
    world: Arc<World>,
    key: usize,
    server: usize,
    ms: u64,
    fails: bool,
) -> (u16, Bytes) {
    let token = REQUEST
        .try_with(|(_, token)| token.get())
        .ok()
        .flatten()
        .expect("the handler runs under a claim the store granted");
    let running = Running::start(&world, key, server, token);
    tokio::time::sleep(Duration::from_millis(ms)).await;
    let status = if fails { 500 } else { 201 };
    let body = format!("k{key} execution {}", running.exec);
    world
        .log()
        .produced
        .insert((status, body.clone().into_bytes()));
    (status, Bytes::from(body))
}

/// Checks a replay against the first stored response.
fn replayed(world: &World, key: usize, status: u16, body: &[u8]) {
    let mut log = world.log();
    log.replays += 1;
    if log.stored.get(&key).map(|(s, b)| (*s, b.as_slice())) != Some((status, body)) {
        log.violation(format!(
            "a replay of k{key} differs from the stored response: {status} {:?}",
            String::from_utf8_lossy(body)
        ));
    }
}

/// Checks a first execution's answer against what its handler produced.
fn fresh(world: &World, key: usize, status: u16, body: &[u8]) {
    let mut log = world.log();
    if !log.produced.contains(&(status, body.to_vec())) {
        log.violation(format!(
            "k{key}: a first execution answered what no handler produced: {status} {:?}",
            String::from_utf8_lossy(body)
        ));
    }
}

/// One server handling one request through the HTTP driver, as both adapters do: prepare,
/// then claim → execute → store → replay around the handler.
async fn serve_http(config: Config, world: Arc<World>, key: usize, server: usize) -> Answer {
    let (ms, fails) = world.draw(|r| (r.random_range(0..=5000), r.random_bool(0.1)));
    let head = RequestHead {
        method: "POST",
        path: "/charges",
        query: None,
        content_type: None,
    };
    let prepared = driver::prepare(
        &config,
        &ROUTE,
        head,
        IdempotencyKey::parse(format!("k{key}").as_bytes()),
        Bytes::from_static(b"{}"),
        Scope::new("acct_sim"),
    )
    .await;
    let driver::Prepared::Run(job) = prepared else {
        world
            .log()
            .violation(format!("k{key}: the driver would not run: {prepared:?}"));
        return Answer::Retry;
    };
    let response = REQUEST
        .scope(
            (server, Cell::new(None)),
            job.run::<SimGlue, _>(|| {
                let world = Arc::clone(&world);
                async move {
                    let (status, body) = handler(world, key, server, ms, fails).await;
                    SimResponse {
                        head: (status, vec![]),
                        body,
                    }
                }
            }),
        )
        .await;
    let (status, headers) = &response.head;
    let replay = headers
        .iter()
        .find(|(n, _)| n == IDEMPOTENT_REPLAYED)
        .map(|(_, v)| v.as_slice());
    match (*status, replay) {
        (201, Some(b"true")) => {
            replayed(&world, key, 201, &response.body);
            world.log().http_replays += 1;
            Answer::Replay(response.body.to_vec())
        }
        (201, Some(b"false")) => {
            fresh(&world, key, 201, &response.body);
            Answer::Fresh(response.body.to_vec())
        }
        // 500 (released), 409 (in progress), 503 (store unavailable).
        (500 | 409 | 503, _) => Answer::Retry,
        _ => {
            world.log().violation(format!(
                "k{key}: the driver answered {status} {headers:?} {:?}",
                response.body
            ));
            Answer::Retry
        }
    }
}

/// One server handling one request on the engine's API: claim; run the handler and store its
/// outcome; or answer from the record.
async fn serve(engine: Engine, world: Arc<World>, key: usize, server: usize) -> Answer {
    let policy = Policy {
        lease: LEASE,
        ttl: TTL,
        route: "sim",
        ..Policy::default()
    };
    let begin = REQUEST
        .scope((server, Cell::new(None)), async {
            let begin = engine.begin(request(key), &policy).await;
            (begin, REQUEST.with(|(_, token)| token.get()))
        })
        .await;
    match begin {
        (Begin::Claimed(mut execution), Some(token)) => {
            let (ms, fails) = world.draw(|r| (r.random_range(0..=5000), r.random_bool(0.1)));
            let run = REQUEST.scope(
                (server, Cell::new(Some(token))),
                handler(Arc::clone(&world), key, server, ms, fails),
            );
            let (status, body) = execution
                .run(run)
                .await
                .expect("the handler does not panic");
            let body = body.to_vec();
            let response = StoredResponse::new(status, body.clone());
            let recorded = execution.finish(response.into()).await;
            world
                .log()
                .event(format!("k{key}: {status} finished as {recorded:?}"));
            if status == 201 {
                Answer::Fresh(body)
            } else {
                Answer::Retry
            }
        }
        (Begin::Claimed(_), None) => {
            world
                .log()
                .violation(format!("k{key}: claimed, and the store never granted it"));
            Answer::Retry
        }
        (Begin::Replay(outcome), _) => {
            let (status, body) = response_of(&outcome);
            replayed(&world, key, status, &body);
            Answer::Replay(body)
        }
        (Begin::InProgress { .. } | Begin::StoreUnavailable(_), _) => Answer::Retry,
        (other, _) => {
            world
                .log()
                .violation(format!("k{key}: unexpected answer {other:?}"));
            Answer::Retry
        }
    }
}

/// What one seed's run produced.
struct Outcome {
    log: Log,
}

/// Runs one seed to its end.
async fn world(seed: u64, arm: Arm) -> Outcome {
    let mut rng = StdRng::seed_from_u64(seed);
    let calm = arm != Arm::Silent && rng.random_bool(0.2);
    let mut faults = if calm {
        Faults {
            max_delay_ms: 50,
            error: 0.0,
            lost: 0.0,
            crash: 0.0,
            jump: 0.0,
            hang: 0.0,
        }
    } else {
        Faults {
            max_delay_ms: rng.random_range(0..MAX_DELAY_MS),
            error: rng.random_range(0.0..0.2),
            lost: rng.random_range(0.0..0.2),
            crash: rng.random_range(0.0..0.1),
            jump: rng.random_range(0.0..0.05),
            hang: 0.0,
        }
    };
    if arm == Arm::Silent {
        faults.max_delay_ms = faults.max_delay_ms.min(SILENT_MAX_DELAY_MS);
        faults.hang = rng.random_range(0.05..0.4);
    }
    let origin = tokio::time::Instant::now();
    let world = Arc::new(World {
        rng: Mutex::new(rng),
        faults,
        log: Mutex::new(Log::default()),
    });
    let clock = Arc::new(WorldClock {
        origin,
        jumped: Mutex::new(Duration::ZERO),
    });
    let store = Arc::new(match arm {
        Arm::Memory | Arm::Silent => SimStore {
            inner: Arc::new(
                MemoryStore::builder()
                    .clock(Arc::new(SimClock(Arc::clone(&clock))))
                    .build(),
            ),
            world: Arc::clone(&world),
            runner: Runner::Direct,
            clock: Arc::clone(&clock),
            #[cfg(feature = "sqlite")]
            sqlite: None,
        },
        #[cfg(feature = "sqlite")]
        Arm::Sqlite => {
            let sqlite = Runner::Blocking
                .run(async {
                    // One in-memory database (one connection), which keeps the simulated
                    // clock in a table of its own that every statement reads the time from.
                    let opened = idempotent_core::SqliteStore::connect("sqlite::memory:")
                        .await
                        .expect("open SQLite");
                    let pool = opened.pool().clone();
                    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                        "CREATE TABLE sim_clock (ms INTEGER NOT NULL); INSERT INTO sim_clock VALUES ({EPOCH_MS})"
                    )))
                    .execute(&pool)
                    .await
                    .expect("create the clock table");
                    let store = idempotent_core::SqliteStore::builder(pool)
                        .clock_sql("(SELECT ms FROM sim_clock)")
                        .build()
                        .expect("SQLite store");
                    store.migrate().await.expect("migrate SQLite");
                    store
                })
                .await;
            SimStore {
                inner: Arc::new(sqlite.clone()),
                world: Arc::clone(&world),
                runner: Runner::Blocking,
                clock: Arc::clone(&clock),
                sqlite: Some(sqlite),
            }
        }
    });
    let servers: Arc<Vec<Mutex<Server>>> = Arc::new(
        (0..SERVERS)
            .map(|_| Mutex::new(Server::start(&store)))
            .collect(),
    );
    let mut clients = JoinSet::new();
    for c in 0..CLIENTS {
        let (world, servers, store) =
            (Arc::clone(&world), Arc::clone(&servers), Arc::clone(&store));
        clients.spawn(async move {
            let key = c % KEYS;
            for attempt in 0..ATTEMPTS {
                let (s, timeout_ms, crash, http) = world.draw(|r| {
                    (
                        r.random_range(0..SERVERS),
                        r.random_range(100..=6000),
                        r.random_bool(world.faults.crash),
                        r.random_bool(0.5),
                    )
                });
                if crash {
                    let s = world.draw(|r| r.random_range(0..SERVERS));
                    let mut server = servers[s].lock().expect("server");
                    // kill -9 and restart: every task it ran is dropped where it stands.
                    server.tasks.abort_all();
                    *server = Server::start(&store);
                    let mut log = world.log();
                    log.crashed(s);
                    log.crashes += 1;
                    log.event(format!("server {s} crashes"));
                }
                let (tx, rx) = tokio::sync::oneshot::channel();
                {
                    let mut server = servers[s].lock().expect("server");
                    let (engine, config) = (server.engine.clone(), server.config.clone());
                    let world = Arc::clone(&world);
                    server.tasks.spawn(async move {
                        let answer = if http {
                            serve_http(config, world, key, s).await
                        } else {
                            serve(engine, world, key, s).await
                        };
                        let _ = tx.send(answer);
                    });
                }
                let via = if http {
                    "the HTTP driver"
                } else {
                    "the engine"
                };
                world.log().event(format!(
                    "client {c} sends k{key} to server {s} through {via} (attempt {attempt})"
                ));
                match tokio::time::timeout(Duration::from_millis(timeout_ms), rx).await {
                    Ok(Ok(Answer::Fresh(body) | Answer::Replay(body))) => {
                        world.log().event(format!(
                            "client {c} is answered: {}",
                            String::from_utf8_lossy(&body)
                        ));
                        return;
                    }
                    // Told to retry, timed out, or its server crashed.
                    Ok(Ok(Answer::Retry)) | Ok(Err(_)) | Err(_) => {
                        let backoff = world.draw(|r| r.random_range(0..=3000));
                        tokio::time::sleep(Duration::from_millis(backoff)).await;
                    }
                }
            }
            world.log().event(format!("client {c} gives up"));
        });
    }
    while clients.join_next().await.is_some() {}
    // Let every execution still running finish (or its server's tasks end).
    for server in servers.iter() {
        let mut tasks = std::mem::take(&mut server.lock().expect("server").tasks);
        while tasks.join_next().await.is_some() {}
    }
    // The store's records hold the first stored responses.
    for k in 0..KEYS {
        let key = request(k);
        let key = RecordKey::new(key.scope, key.key.expect("key"));
        let record = store.get(&key).await.expect("read the record");
        let mut log = world.log();
        let stored = log.stored.get(&k).cloned();
        match (record.map(|r| r.state), stored) {
            (Some(RecordState::Done { outcome, .. }), Some(first))
                if response_of(&outcome) == first => {}
            (Some(RecordState::Done { outcome, .. }), first) => log.violation(format!(
                "k{k}'s record holds {:?}, the first stored was {first:?}",
                response_of(&outcome)
            )),
            (_, Some(_)) => log.violation(format!("k{k}'s stored response is gone")),
            (_, None) => {}
        }
    }
    drop(servers);
    let log = std::mem::take(&mut *world.log());
    Outcome { log }
}

/// Runs `seed` on a fresh single-threaded runtime with a paused clock.
fn run_seed(seed: u64, arm: Arm) -> Outcome {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("runtime")
        .block_on(world(seed, arm))
}

/// Runs the arm's seeds (or `SIM_SEED` alone) and fails on the first seed that breaks an
/// invariant, naming it.
fn run_arm(arm: Arm, default_seeds: u64) {
    if let Ok(seed) = std::env::var("SIM_SEED") {
        let seed: u64 = seed.parse().expect("SIM_SEED is a number");
        let outcome = run_seed(seed, arm);
        for e in &outcome.log.events {
            eprintln!("{e}");
        }
        assert!(
            outcome.log.violations.is_empty(),
            "{arm:?} seed {seed}: {:?}",
            outcome.log.violations
        );
        return;
    }
    let var = |name: &str| std::env::var(name).ok().and_then(|s| s.parse::<u64>().ok());
    let seeds = var("SIM_SEEDS").unwrap_or(default_seeds);
    let base = var("SIM_SEED_BASE").unwrap_or(0);
    let budget = var("SIM_BUDGET_SECS").map_or(BUDGET, Duration::from_secs);
    let started = Instant::now();
    let mut totals = Log::default();
    let mut ran = 0;
    for seed in base..base + seeds {
        if started.elapsed() > budget {
            break;
        }
        let log = run_seed(seed, arm).log;
        assert!(
            log.violations.is_empty(),
            "{arm:?} seed {seed} breaks an invariant: {:?}\nreproduce: SIM_SEED={seed} cargo test -p idempotent-tests --test simulation {} -- --nocapture",
            log.violations,
            match arm {
                Arm::Memory => "memory",
                #[cfg(feature = "sqlite")]
                Arm::Sqlite => "sqlite",
                Arm::Silent => "silent",
            }
        );
        totals.executions += log.executions;
        totals.replays += log.replays;
        totals.http_replays += log.http_replays;
        totals.crashes += log.crashes;
        totals.lost += log.lost;
        totals.errors += log.errors;
        totals.jumps += log.jumps;
        totals.live_takeovers += log.live_takeovers;
        totals.refused += log.refused;
        totals.hangs += log.hangs;
        ran += 1;
    }
    eprintln!(
        "{arm:?}: seeds {base}..{}, {ran} run in {:.1?}: {} executions, {} replays ({} through the HTTP driver), {} crashes, {} lost answers, {} failed operations, {} clock jumps, {} take-overs of a running execution, {} stale writes refused, {} writes that never answered",
        base + ran,
        started.elapsed(),
        totals.executions,
        totals.replays,
        totals.http_replays,
        totals.crashes,
        totals.lost,
        totals.errors,
        totals.jumps,
        totals.live_takeovers,
        totals.refused,
        totals.hangs
    );
    // The faults happened: a simulation that never reaches them checks nothing.
    assert!(ran >= 50, "only {ran} seeds ran within the budget");
    assert!(totals.replays > totals.http_replays && totals.http_replays > 0);
    assert!(totals.crashes > 0 && totals.lost > 0 && totals.errors > 0);
    assert!(
        totals.refused > 0,
        "no stale write ever reached the store's fence"
    );
    assert!(
        totals.jumps > 0 && totals.live_takeovers > 0,
        "no take-over of a running execution was reached"
    );
    assert!(
        arm != Arm::Silent || totals.hangs > 0,
        "no write ever hung in the silent-connection arm"
    );
}

#[test]
fn memory_store_under_simulation() {
    run_arm(Arm::Memory, 5_000);
}

#[cfg(feature = "sqlite")]
#[test]
fn sqlite_store_under_simulation() {
    run_arm(Arm::Sqlite, 1_000);
}

/// Renewals, completes and releases that never answer (issue 49): the engine's bound on each
/// renewal attempt, and its second attempt on another connection, keep a running owner's
/// lease. Before renewals were bounded, a hung renewal held the heartbeat for good and the
/// lease ran out under a live handler.
#[test]
fn silent_connections_under_simulation() {
    run_arm(Arm::Silent, 5_000);
}

#[test]
fn a_seed_replays_the_same_run() {
    let arms = [
        Arm::Memory,
        #[cfg(feature = "sqlite")]
        Arm::Sqlite,
        Arm::Silent,
    ];
    for arm in arms {
        for seed in [3, 17, 101, 31] {
            let first = run_seed(seed, arm).log.events;
            let second = run_seed(seed, arm).log.events;
            assert!(first.len() > 10, "{arm:?} seed {seed} did something");
            assert_eq!(
                first, second,
                "{arm:?} seed {seed} ran two different schedules"
            );
        }
    }
}

/// SQLite follows the simulated clock closely enough that, seed for seed, it answers every
/// operation as the memory store does: the same schedule, event for event. A difference is a
/// store that behaves otherwise, or a clock the simulation does not control.
#[cfg(feature = "sqlite")]
#[test]
fn sqlite_and_memory_run_the_same_schedules() {
    for seed in 0..200 {
        let memory = run_seed(seed, Arm::Memory).log.events;
        let sqlite = run_seed(seed, Arm::Sqlite).log.events;
        if let Some(i) = memory.iter().zip(&sqlite).position(|(m, s)| m != s) {
            panic!(
                "seed {seed}: the stores part at event {i}: memory {:?}, SQLite {:?}",
                &memory[i.saturating_sub(3)..(i + 1).min(memory.len())],
                &sqlite[i.saturating_sub(3)..(i + 1).min(sqlite.len())]
            );
        }
        assert_eq!(
            memory.len(),
            sqlite.len(),
            "seed {seed}: one store's run is longer"
        );
    }
}
