//! The local replay cache ([`ReplayCache`]): completed records kept in process memory, so a
//! retry of a finished request is answered without a store round trip.
//!
//! Only completed records are kept: a record this engine completed itself (after its complete,
//! or its transaction's commit, succeeded) and a completed record a claim read from the store.
//! A completed record does not change while it lives, so a kept copy answers exactly what the
//! store would: the stored outcome to a request with the same fingerprint, a mismatch (422) to
//! another request under the key. An entry lives until the record's expiry (as the store
//! reported it, measured from before the call that reported it) or the cache's
//! [`max_age`](ReplayCache::max_age), whichever comes first; `max_age` is therefore the bound
//! on how long an instance keeps replaying a record that was deleted (`idempotent-admin`) or
//! rewritten in the store behind it.
//!
//! Bounded in bytes (an estimate of what an entry holds, as the memory store estimates its
//! records) and per scope, so one caller's replays cannot evict everyone's: an entry that
//! would take its scope past [`max_bytes_per_scope`](ReplayCache::max_bytes_per_scope) is not
//! kept (that request simply goes to the store next time). The unscoped namespace is bounded by
//! [`max_bytes`](ReplayCache::max_bytes) alone, as in the memory store.
//!
//! Built on `moka` (its synchronous cache): a concurrent cache with a size-aware admission and
//! eviction policy (TinyLFU), a weigher for byte bounds, a time to live and an eviction
//! listener, which is every piece this needs; see ARCHITECTURE.md for the choice.

use crate::fingerprint::Fingerprint;
use crate::scope::Scope;
use crate::store::record::{RecordKey, StoredOutcome};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Default [`ReplayCache::max_bytes`]: 64 MiB.
pub const DEFAULT_CACHE_MAX_BYTES: u64 = 64 << 20;
/// Default [`ReplayCache::max_bytes_per_scope`]: 8 MiB.
pub const DEFAULT_CACHE_MAX_BYTES_PER_SCOPE: u64 = 8 << 20;
/// Default [`ReplayCache::max_age`]: 5 s.
pub const DEFAULT_CACHE_MAX_AGE: Duration = Duration::from_secs(5);

/// What one entry costs besides its scope, key and outcome: the entry, its `Arc`, the cache's
/// node and its bookkeeping (an estimate, as the memory store's record overhead is).
const ENTRY_OVERHEAD: u64 = 256;

/// The settings of an engine's local replay cache ([`EngineBuilder::replay_cache`]).
///
/// ```
/// use std::time::Duration;
/// use idempotent_core::engine::ReplayCache;
/// use idempotent_core::{Engine, MemoryStore};
///
/// let engine = Engine::builder(MemoryStore::new())
///     .replay_cache(ReplayCache::new().max_bytes(16 << 20).max_age(Duration::from_secs(2)))
///     .build()?;
/// assert!(engine.replay_cache().is_some());
/// # Ok::<(), idempotent_core::engine::ConfigError>(())
/// ```
///
/// [`EngineBuilder::replay_cache`]: super::EngineBuilder::replay_cache
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub struct ReplayCache {
    max_bytes: u64,
    max_bytes_per_scope: u64,
    max_age: Duration,
}

impl Default for ReplayCache {
    fn default() -> Self {
        ReplayCache {
            max_bytes: DEFAULT_CACHE_MAX_BYTES,
            max_bytes_per_scope: DEFAULT_CACHE_MAX_BYTES_PER_SCOPE,
            max_age: DEFAULT_CACHE_MAX_AGE,
        }
    }
}

impl ReplayCache {
    /// The defaults: 64 MiB in all, 8 MiB per scope, entries at most 5 s old.
    pub fn new() -> Self {
        Self::default()
    }

    /// The most bytes all entries hold, as the cache estimates them (default 64 MiB); past it
    /// the least useful entries are evicted.
    pub fn max_bytes(mut self, bytes: u64) -> Self {
        self.max_bytes = bytes;
        self
    }

    /// The most bytes one scope's entries hold (default 8 MiB); an entry that would take its
    /// scope past it is not kept. The unscoped namespace is bounded by
    /// [`max_bytes`](Self::max_bytes) alone.
    pub fn max_bytes_per_scope(mut self, bytes: u64) -> Self {
        self.max_bytes_per_scope = bytes;
        self
    }

    /// The longest an entry is kept (default 5 s), however long its record lives: the bound on
    /// how long this instance may replay a record deleted or rewritten in the store behind it.
    /// 1 ms to 365 days.
    pub fn max_age(mut self, age: Duration) -> Self {
        self.max_age = age;
        self
    }

    /// The configured byte budget.
    pub fn bytes(&self) -> u64 {
        self.max_bytes
    }

    /// The configured per-scope byte budget.
    pub fn bytes_per_scope(&self) -> u64 {
        self.max_bytes_per_scope
    }

    /// The configured longest age.
    pub fn age(&self) -> Duration {
        self.max_age
    }

    /// Checks the settings.
    pub(crate) fn check(&self) -> Result<(), super::ConfigError> {
        if self.max_bytes == 0 {
            return Err(super::ConfigError::ZeroSize {
                what: "replay_cache.max_bytes",
            });
        }
        if self.max_bytes_per_scope == 0 {
            return Err(super::ConfigError::ZeroSize {
                what: "replay_cache.max_bytes_per_scope",
            });
        }
        if self.max_age < Duration::from_millis(1) {
            return Err(super::ConfigError::TooShort {
                what: "replay_cache.max_age",
                value: self.max_age,
            });
        }
        if self.max_age > super::MAX_DURATION {
            return Err(super::ConfigError::TooLong {
                what: "replay_cache.max_age",
                value: self.max_age,
            });
        }
        Ok(())
    }
}

/// A kept record.
struct Entry {
    fingerprint: Fingerprint,
    outcome: StoredOutcome,
    /// When it stops answering (the earlier of the record's expiry and the cache's max age).
    until: Instant,
    /// Its estimated size, as charged.
    bytes: u64,
}

/// Where a kept record came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kept {
    /// This engine's own complete or commit.
    Own,
    /// A read of the store.
    Read,
}

/// What a look in the cache found.
#[derive(Debug)]
pub(crate) enum Looked {
    /// The record, completed, with this request's fingerprint: its outcome.
    Hit(StoredOutcome),
    /// The record, completed, belongs to another request.
    Mismatch,
    /// Nothing kept.
    Miss,
}

/// An engine's cache.
pub(crate) struct Cache {
    settings: ReplayCache,
    entries: moka::sync::Cache<RecordKey, Arc<Entry>>,
    /// Bytes held per (counted) scope; a scope with none is removed.
    scopes: Arc<Mutex<HashMap<Scope, u64>>>,
    /// Bytes held in all, as charged at insert and given back at removal.
    bytes: Arc<AtomicU64>,
}

impl std::fmt::Debug for Cache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cache")
            .field("settings", &self.settings)
            .field("bytes", &self.bytes.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Cache {
    pub(crate) fn new(settings: ReplayCache) -> Self {
        let scopes: Arc<Mutex<HashMap<Scope, u64>>> = Arc::default();
        let bytes = Arc::new(AtomicU64::new(0));
        let (listener_scopes, listener_bytes) = (Arc::clone(&scopes), Arc::clone(&bytes));
        let entries = moka::sync::Cache::builder()
            .max_capacity(settings.max_bytes)
            .weigher(|_key: &RecordKey, entry: &Arc<Entry>| {
                u32::try_from(entry.bytes).unwrap_or(u32::MAX)
            })
            // Every entry goes at `max_age`; one whose record ends sooner never answers after
            // that (`look` checks its own deadline) and is gone by `max_age` (a timer per entry
            // cost first executions more than the memory it frees sooner).
            .time_to_live(settings.max_age)
            .eviction_listener(
                move |key: Arc<RecordKey>,
                      entry: Arc<Entry>,
                      cause: moka::notification::RemovalCause| {
                    listener_bytes.fetch_sub(entry.bytes, Ordering::AcqRel);
                    give_back(&listener_scopes, &key.scope, entry.bytes);
                    if cause == moka::notification::RemovalCause::Size {
                        crate::observe::replay_cache_eviction();
                    }
                    crate::observe::replay_cache_bytes(listener_bytes.load(Ordering::Relaxed));
                },
            )
            .build();
        Cache {
            settings,
            entries,
            scopes,
            bytes,
        }
    }

    /// The record kept for `key`, judged against `fingerprint` (counted as a hit, a miss or a
    /// mismatch).
    pub(crate) fn look(&self, key: &RecordKey, fingerprint: &Fingerprint) -> Looked {
        let looked = match self.entries.get(key) {
            // moka expires entries on their own deadline; checked here too, so an entry never
            // answers past it whatever moka's clock granularity.
            Some(entry) if entry.until > Instant::now() => {
                if fingerprint.matches_stored(&entry.fingerprint) {
                    Looked::Hit(entry.outcome.clone())
                } else {
                    Looked::Mismatch
                }
            }
            _ => Looked::Miss,
        };
        crate::observe::replay_cache_look(match looked {
            Looked::Hit(_) => "hit",
            Looked::Mismatch => "mismatch",
            Looked::Miss => "miss",
        });
        looked
    }

    /// Keeps a completed record whose store expiry is at least `lives` after `since` (an
    /// instant before the call that reported or set it). Not kept: a record with no life left,
    /// one larger than its scope's budget (or the whole cache), or one that would take its
    /// scope past its budget.
    /// Keeps a completed record whose store expiry is at least `lives` after `since` (an
    /// instant before the call that reported or set it), from `kept`: a record this engine
    /// completed or committed itself ([`Kept::Own`]; a live copy of its key is there only when
    /// the record was deleted in the store behind it, and the store's new record replaces it)
    /// or one it read ([`Kept::Read`]). Not kept: a record with no life left, one larger than
    /// its scope's budget (or the whole cache), or one that would take its scope past its
    /// budget.
    pub(crate) fn keep(
        &self,
        kept: Kept,
        key: &RecordKey,
        fingerprint: Fingerprint,
        outcome: StoredOutcome,
        since: Instant,
        lives: Duration,
    ) {
        let now = Instant::now();
        // A millisecond short of what the store said: stores count time in whole milliseconds
        // (MySQL and SQLite round their now down, PostgreSQL rounds what is left to the nearest).
        let lives = lives.saturating_sub(Duration::from_millis(1));
        let until = (since + lives).min(now + self.settings.max_age);
        if until <= now {
            return;
        }
        // A live copy of a record read from the store may be kept already (a completed record
        // does not change: the same record read again by a waiter, or by a look racing its own
        // complete): not charged twice.
        if kept == Kept::Read && self.entries.get(key).is_some_and(|entry| entry.until > now) {
            return;
        }
        let bytes = ENTRY_OVERHEAD
            + (key.scope.as_str().len() + key.key.as_str().len()) as u64
            + outcome_bytes(&outcome);
        if bytes > self.settings.max_bytes || bytes > u64::from(u32::MAX) {
            return;
        }
        if !key.scope.is_shared() && !self.charge_scope(&key.scope, bytes) {
            crate::observe::replay_cache_refused();
            return;
        }
        self.bytes.fetch_add(bytes, Ordering::AcqRel);
        let entry = Arc::new(Entry {
            fingerprint,
            outcome,
            until,
            bytes,
        });
        // A replaced entry (two completes of one key cannot both succeed, but a store read and
        // an own complete can race) is given back by the listener.
        self.entries.insert(key.clone(), entry);
        crate::observe::replay_cache_bytes(self.bytes.load(Ordering::Relaxed));
    }

    /// Charges `bytes` to `scope` if that keeps it within its budget.
    fn charge_scope(&self, scope: &Scope, bytes: u64) -> bool {
        if bytes > self.settings.max_bytes_per_scope {
            return false;
        }
        let mut scopes = lock(&self.scopes);
        // Looked up by reference: the scope is cloned only for its first entry.
        match scopes.get_mut(scope) {
            Some(held) if held.saturating_add(bytes) > self.settings.max_bytes_per_scope => false,
            Some(held) => {
                *held += bytes;
                true
            }
            None => {
                scopes.insert(scope.clone(), bytes);
                true
            }
        }
    }

    /// Bytes held, as charged (pending removals are counted until moka runs them).
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Bytes held by `scope`'s entries.
    pub(crate) fn scope_bytes(&self, scope: &Scope) -> u64 {
        lock(&self.scopes).get(scope).copied().unwrap_or(0)
    }

    /// Runs moka's pending maintenance (evictions, expiries, the listener) now.
    pub(crate) fn settle(&self) {
        self.entries.run_pending_tasks();
    }

    pub(crate) fn settings(&self) -> ReplayCache {
        self.settings
    }
}

/// Gives `bytes` back to `scope` (a shared scope was never charged: no entry).
fn give_back(scopes: &Mutex<HashMap<Scope, u64>>, scope: &Scope, bytes: u64) {
    if scope.is_shared() {
        return;
    }
    let mut scopes = lock(scopes);
    if let Some(held) = scopes.get_mut(scope) {
        *held = held.saturating_sub(bytes);
        if *held == 0 {
            scopes.remove(scope);
        }
    }
}

/// What an outcome holds in memory: its body and header bytes, 48 bytes per header line.
fn outcome_bytes(outcome: &StoredOutcome) -> u64 {
    match outcome {
        StoredOutcome::Response(r) => {
            (r.body.len()
                + r.headers
                    .iter()
                    .map(|(n, v)| 48 + n.len() + v.len())
                    .sum::<usize>()) as u64
        }
        StoredOutcome::Oversized { .. } => 16,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fingerprint::FingerprintInput;
    use crate::key::IdempotencyKey;
    use crate::store::record::StoredResponse;

    fn fp(body: &[u8]) -> Fingerprint {
        Fingerprint::compute(&FingerprintInput {
            method: "POST",
            path: "/p",
            query: None,
            content_type: None,
            body,
        })
    }

    fn key(scope: &str, k: &str) -> RecordKey {
        RecordKey::new(
            Scope::new(scope).unwrap(),
            IdempotencyKey::parse(k.as_bytes()).unwrap(),
        )
    }

    fn outcome(n: usize) -> StoredOutcome {
        StoredResponse::new(201, vec![b'x'; n]).into()
    }

    #[test]
    fn hits_mismatches_and_misses() {
        let cache = Cache::new(ReplayCache::new());
        let k = key("a", "k1");
        cache.keep(
            Kept::Read,
            &k,
            fp(b"1"),
            outcome(10),
            Instant::now(),
            Duration::from_secs(60),
        );
        assert!(matches!(cache.look(&k, &fp(b"1")), Looked::Hit(o) if o == outcome(10)));
        assert!(matches!(cache.look(&k, &fp(b"2")), Looked::Mismatch));
        // Another scope with the same key never hits.
        assert!(matches!(
            cache.look(&key("b", "k1"), &fp(b"1")),
            Looked::Miss
        ));
    }

    #[test]
    fn an_entry_never_outlives_its_record_or_max_age() {
        let cache = Cache::new(ReplayCache::new().max_age(Duration::from_millis(1_500)));
        let (short, long) = (key("a", "short"), key("a", "long"));
        // The record expires 500 ms after `since`; max age is 1.5 s.
        let since = Instant::now();
        cache.keep(
            Kept::Read,
            &short,
            fp(b""),
            outcome(1),
            since,
            Duration::from_millis(500),
        );
        cache.keep(
            Kept::Read,
            &long,
            fp(b""),
            outcome(1),
            since,
            Duration::from_secs(3600),
        );
        let looked = Instant::now();
        let hit = matches!(cache.look(&short, &fp(b"")), Looked::Hit(_));
        // (A machine that stalled half a second between these proves nothing either way.)
        if looked < since + Duration::from_millis(450) {
            assert!(hit, "a live record missed");
        }
        std::thread::sleep(Duration::from_millis(600).saturating_sub(since.elapsed()));
        assert!(matches!(cache.look(&short, &fp(b"")), Looked::Miss));
        if since.elapsed() < Duration::from_millis(1_400) {
            assert!(matches!(cache.look(&long, &fp(b"")), Looked::Hit(_)));
        }
        std::thread::sleep(Duration::from_millis(1_600).saturating_sub(since.elapsed()));
        assert!(matches!(cache.look(&long, &fp(b"")), Looked::Miss));
        // A record with no life left is never kept.
        let gone = key("a", "gone");
        let since = Instant::now().checked_sub(Duration::from_secs(2)).unwrap();
        cache.keep(
            Kept::Read,
            &gone,
            fp(b""),
            outcome(1),
            since,
            Duration::from_secs(1),
        );
        assert!(matches!(cache.look(&gone, &fp(b"")), Looked::Miss));
        // moka removes entries at their time to live (`max_age`, 1.5 s here), in its
        // maintenance: their bytes come back within a few seconds.
        let until = Instant::now() + Duration::from_secs(5);
        while cache.bytes() != 0 && Instant::now() < until {
            cache.settle();
            std::thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(cache.bytes(), 0, "expired entries give their bytes back");
    }

    #[test]
    fn bytes_are_bounded_in_all_and_per_scope() {
        let cache = Cache::new(
            ReplayCache::new()
                .max_bytes(200_000)
                .max_bytes_per_scope(50_000),
        );
        let life = Duration::from_secs(60);
        // A 1 KB record of `k`, living a minute.
        let keep = |k: &RecordKey| {
            cache.keep(Kept::Read, k, fp(b""), outcome(1_000), Instant::now(), life);
        };
        // One scope stores far past its budget: it keeps at most its budget.
        for i in 0..500 {
            keep(&key("greedy", &format!("k{i}")));
        }
        cache.settle();
        let greedy = Scope::new("greedy").unwrap();
        assert!(
            cache.scope_bytes(&greedy) <= 50_000,
            "{}",
            cache.scope_bytes(&greedy)
        );
        assert!(cache.scope_bytes(&greedy) > 40_000);
        // Others still get room: the greedy scope did not take it.
        for s in 0..3 {
            let k = key(&format!("s{s}"), "k");
            keep(&k);
            assert!(matches!(cache.look(&k, &fp(b"")), Looked::Hit(_)));
        }
        // Many scopes at once: the total stays within the budget.
        for s in 0..100 {
            for i in 0..20 {
                let k = key(&format!("many{s}"), &format!("k{i}"));
                keep(&k);
            }
        }
        cache.settle();
        assert!(cache.bytes() <= 200_000, "{}", cache.bytes());
        assert_eq!(cache.bytes(), cache.entries.weighted_size());
        // An entry larger than a scope's budget is never kept.
        let big = key("a", "big");
        cache.keep(
            Kept::Read,
            &big,
            fp(b""),
            outcome(60_000),
            Instant::now(),
            life,
        );
        assert!(matches!(cache.look(&big, &fp(b"")), Looked::Miss));
    }

    /// Through an engine: a record is never replayed past its expiry, whether the copy came
    /// from this engine's own complete (bounded by the ttl from before it) or from a later read
    /// of the store (bounded by the life the store reported).
    #[tokio::test]
    async fn an_engine_never_replays_an_expired_record_from_its_cache() {
        use crate::engine::Engine;
        use crate::engine::{Begin, ExecuteRequest, Policy};
        use crate::store::MemoryStore;
        let engine = Engine::builder(MemoryStore::new())
            .replay_cache(ReplayCache::new().max_age(Duration::from_secs(60)))
            .build()
            .unwrap();
        let policy = Policy {
            ttl: Duration::from_millis(200),
            lease: Duration::from_millis(100),
            ..Policy::default()
        };
        let k = key("a", "expiring");
        let request = || ExecuteRequest {
            scope: k.scope.clone(),
            key: Ok(k.key.clone()),
            fingerprint: fp(b"x"),
        };
        let Begin::Claimed(execution) = engine.begin(request(), &policy).await else {
            panic!("the first request claims");
        };
        // The store's expiry is at most lease + ttl after the claim, which was before this.
        let expires_by = Instant::now() + policy.lease + policy.ttl;
        execution.finish(outcome(3)).await;
        assert!(
            engine.replay_cache_bytes(None).unwrap() > 0,
            "kept after its complete"
        );
        let mut replays = 0;
        loop {
            let asked = Instant::now();
            match engine.begin(request(), &policy).await {
                Begin::Replay(_) => {
                    assert!(
                        asked < expires_by,
                        "replayed {:?} after the record expired",
                        asked - expires_by
                    );
                    replays += 1;
                }
                Begin::Claimed(_) => break,
                other => panic!("{other:?}"),
            }
            assert!(asked < expires_by + Duration::from_secs(2), "never expired");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(replays > 3, "{replays}");
    }

    #[test]
    fn settings_are_checked() {
        assert!(ReplayCache::new().check().is_ok());
        assert!(ReplayCache::new().max_bytes(0).check().is_err());
        assert!(ReplayCache::new().max_bytes_per_scope(0).check().is_err());
        assert!(ReplayCache::new().max_age(Duration::ZERO).check().is_err());
    }
}
