//! The in-memory store: the embedded default for one process.

use crate::store::{ClaimOutcome, ClaimRequest, Deleted, Store, StoreError};
use crate::{
    Clock, Fingerprint, Lease, LeaseToken, Record, RecordKey, RecordState, Scope, StoredOutcome,
    StoredResponse, SystemClock,
};
use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

/// An in-process store, correct under heavy concurrency.
///
/// Records live in sharded maps behind short, synchronous locks that are never held across an
/// `.await`; every operation is one critical section, so `claim` is atomic. At most
/// `max_entries` records are held: when full, expired records are purged, and if it is still
/// full a claim fails with [`StoreError::Capacity`] (live records are never evicted, since that
/// would let a retry run the handler twice). Records do not survive a restart and are not
/// shared between processes; use the SQL stores for that.
///
/// # One caller cannot fill it for everyone
/// Each scope (caller) holds at most `max_per_scope` records (default 100,000), so a caller
/// sending fresh keys as fast as it can fills its own share and then gets
/// [`StoreError::ScopeCapacity`] (HTTP: 503 with `Retry-After`), while other callers' claims
/// go on. Expired records count until purged, and they are purged first: a claim refused for
/// room purges every expired record (at most once a second, so a caller hammering a full
/// store cannot make each of its requests scan the whole store) and tries again. The unscoped
/// namespaces shared by every caller, unscoped routes' (`Scope::unscoped()`) and unscoped
/// idempotent functions' (queue consumers deduplicating by message id), have no per-scope
/// bound; `max_entries` bounds them.
///
/// The per-scope bound is a ceiling on *live* records, so it also limits a legitimate busy
/// caller: with the default ttl of 24 hours, a caller sending more than about 1.1 new keys a
/// second on average (100,000 a day) meets it. Size `max_per_scope` (and the ttl) for your
/// busiest caller, or use a SQL store, which has no such bound.
///
/// ```
/// use idempotent_core::MemoryStore;
/// let store = MemoryStore::builder()
///     .max_entries(10_000)
///     .max_per_scope(1_000)
///     .build();
/// # let _ = store;
/// ```
#[derive(Debug, Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

/// One shard's records.
type Shard = HashMap<RecordKey, Box<Entry>>;

#[derive(Debug)]
struct Inner {
    shards: Box<[Mutex<Shard>]>,
    hasher: RandomState,
    len: AtomicUsize,
    max_entries: usize,
    /// Records held per scope, sharded by the scope's hash (taken after a record shard's lock,
    /// never before, and never across another lock).
    per_scope: Box<[Mutex<HashMap<Scope, usize>>]>,
    max_per_scope: usize,
    /// When the last purge for room ran (by the store's clock; `None`: never).
    last_room_purge: Mutex<Option<SystemTime>>,
    clock: Arc<dyn Clock>,
}

/// Builds a [`MemoryStore`].
#[derive(Debug)]
pub struct MemoryStoreBuilder {
    max_entries: usize,
    max_per_scope: usize,
    clock: Arc<dyn Clock>,
}

impl MemoryStoreBuilder {
    /// Upper bound on records held (default 1,000,000).
    #[must_use]
    pub fn max_entries(mut self, n: usize) -> Self {
        self.max_entries = n;
        self
    }

    /// Upper bound on records one scope holds (default 100,000; at least 1), so one caller
    /// cannot fill the store for everyone. The unscoped namespace is bounded by
    /// [`max_entries`](Self::max_entries) alone.
    #[must_use]
    pub fn max_per_scope(mut self, n: usize) -> Self {
        self.max_per_scope = n.max(1);
        self
    }

    /// The clock leases and expiry are measured with (default: the system clock).
    #[must_use]
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Builds the store.
    pub fn build(self) -> MemoryStore {
        let n = (std::thread::available_parallelism().map_or(4, |n| n.get()) * 8)
            .next_power_of_two()
            .max(16);
        MemoryStore {
            inner: Arc::new(Inner {
                shards: (0..n).map(|_| Mutex::new(HashMap::new())).collect(),
                hasher: RandomState::new(),
                len: AtomicUsize::new(0),
                max_entries: self.max_entries,
                per_scope: (0..n).map(|_| Mutex::new(HashMap::new())).collect(),
                max_per_scope: self.max_per_scope,
                last_room_purge: Mutex::new(None),
                clock: self.clock,
            }),
        }
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// A store with the defaults (1,000,000 records, 100,000 per scope, system clock).
    pub fn new() -> Self {
        Self::builder().build()
    }

    /// Starts a builder.
    pub fn builder() -> MemoryStoreBuilder {
        MemoryStoreBuilder {
            max_entries: 1_000_000,
            max_per_scope: 100_000,
            clock: Arc::new(SystemClock),
        }
    }

    /// Records held, expired ones included until purged.
    pub fn len(&self) -> usize {
        self.inner.len.load(Ordering::Relaxed)
    }

    /// Whether no record is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn shard(&self, key: &RecordKey) -> MutexGuard<'_, Shard> {
        let i = self.inner.hasher.hash_one(key) as usize & (self.inner.shards.len() - 1);
        // A poisoned shard only means a panic elsewhere mid-operation; every operation leaves
        // the map consistent before it can panic, so keep going.
        self.inner.shards[i]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    fn now(&self) -> SystemTime {
        self.inner.clock.now()
    }

    /// Counts one more record for `scope`, unless it holds its share already (the shared
    /// namespaces, unscoped routes' and unscoped functions', are not counted).
    fn reserve_in_scope(&self, scope: &Scope) -> bool {
        if scope.is_shared() {
            return true;
        }
        let mut counts = self.scope_counts(scope);
        let n = counts.entry(scope.clone()).or_insert(0);
        if *n >= self.inner.max_per_scope {
            return false;
        }
        *n += 1;
        true
    }

    /// Counts one record fewer for `scope`.
    fn unreserve_in_scope(&self, scope: &Scope) {
        if scope.is_shared() {
            return;
        }
        let mut counts = self.scope_counts(scope);
        if let Some(n) = counts.get_mut(scope) {
            *n -= 1;
            if *n == 0 {
                counts.remove(scope);
            }
        }
    }

    fn scope_counts(&self, scope: &Scope) -> MutexGuard<'_, HashMap<Scope, usize>> {
        let i = self.inner.hasher.hash_one(scope) as usize & (self.inner.per_scope.len() - 1);
        self.inner.per_scope[i]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Purges expired records to make room, unless that ran less than a second ago (by the
    /// store's clock). Whether it ran.
    fn purge_for_room(&self) -> bool {
        let now = self.now();
        {
            let mut last = self
                .inner
                .last_room_purge
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            // Due when it never ran, a second has passed, or the clock went back.
            let due = last.is_none_or(|last| {
                now.duration_since(last)
                    .map_or(true, |d| d >= Duration::from_secs(1))
            });
            if !due {
                return false;
            }
            *last = Some(now);
        }
        self.purge(usize::MAX);
        true
    }

    fn purge(&self, batch: usize) -> u64 {
        let now = self.now();
        let mut purged = 0_u64;
        let mut left = batch;
        for shard in self.inner.shards.iter() {
            if left == 0 {
                break;
            }
            let mut map = shard.lock().unwrap_or_else(|e| e.into_inner());
            let before = map.len();
            map.retain(|k, r| {
                if left > 0 && r.expires_at <= now {
                    left -= 1;
                    self.unreserve_in_scope(&k.scope);
                    false
                } else {
                    true
                }
            });
            let removed = before - map.len();
            self.inner.len.fetch_sub(removed, Ordering::Relaxed);
            purged += removed as u64;
        }
        purged
    }

    fn try_claim(&self, req: &ClaimRequest<'_>) -> Result<ClaimOutcome, Refused> {
        let now = self.now();
        let mut map = self.shard(req.key);
        let fresh = |took_over| {
            let token = LeaseToken::generate();
            let locked_until = later(now, req.lease);
            let lease = Lease {
                token,
                locked_until,
                took_over,
            };
            let record = Entry {
                // As a SQL store keeps it: version and digest.
                fingerprint: req.fingerprint.to_stored(),
                state: EntryState::InProgress {
                    token,
                    locked_until,
                },
                created_at: now,
                expires_at: later(now, req.lease.saturating_add(req.ttl)),
            };
            (lease, record)
        };
        match map.get_mut(req.key) {
            None => {
                // Reserve a slot first, so claims racing on other shards cannot overshoot.
                let max = self.inner.max_entries;
                if self
                    .inner
                    .len
                    .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                        (n < max).then_some(n + 1)
                    })
                    .is_err()
                {
                    return Err(Refused::Full);
                }
                if !self.reserve_in_scope(&req.key.scope) {
                    self.inner.len.fetch_sub(1, Ordering::AcqRel);
                    return Err(Refused::ScopeFull);
                }
                let (lease, record) = fresh(false);
                map.insert(req.key.clone(), Box::new(record));
                Ok(ClaimOutcome::Claimed(lease))
            }
            Some(rec) if rec.expires_at <= now => {
                // Past its ttl: the record counts as absent, whatever its fingerprint.
                let (lease, record) = fresh(true);
                **rec = record;
                Ok(ClaimOutcome::Claimed(lease))
            }
            Some(rec) if !req.fingerprint.matches_stored(&rec.fingerprint()) => {
                Ok(ClaimOutcome::Mismatch {
                    in_progress: matches!(rec.state, EntryState::InProgress { .. }),
                })
            }
            Some(rec) => match &rec.state {
                EntryState::Done { outcome, .. } => match outcome.unpack() {
                    Some(outcome) => Ok(ClaimOutcome::Replay(outcome)),
                    None => Err(Refused::Corrupt),
                },
                EntryState::InProgress { locked_until, .. } if *locked_until > now => {
                    Ok(ClaimOutcome::InProgress {
                        retry_after: locked_until.duration_since(now).unwrap_or_default(),
                    })
                }
                EntryState::InProgress { .. } => {
                    // Lease ran out, same fingerprint: take over with a new token.
                    let (lease, mut record) = fresh(true);
                    record.created_at = rec.created_at;
                    **rec = record;
                    Ok(ClaimOutcome::Claimed(lease))
                }
            },
        }
    }

    /// Runs `f` on the live, in-progress record held by `token`, or fails with `StaleLease`.
    fn fenced<T>(
        &self,
        key: &RecordKey,
        token: LeaseToken,
        f: impl FnOnce(&mut Shard, SystemTime) -> T,
    ) -> Result<T, StoreError> {
        let now = self.now();
        let mut map = self.shard(key);
        match map.get(key).map(|entry| &**entry) {
            Some(Entry {
                state: EntryState::InProgress { token: held, .. },
                expires_at,
                ..
            }) if *held == token && *expires_at > now => Ok(f(&mut map, now)),
            _ => Err(StoreError::StaleLease),
        }
    }
}

/// Why [`MemoryStore::try_claim`] did not answer.
enum Refused {
    /// No room for a new record.
    Full,
    /// No room for a new record of this scope.
    ScopeFull,
    /// A packed response did not unpack (cannot happen: this store packed it).
    Corrupt,
}

fn corrupt() -> StoreError {
    StoreError::Corrupt("a packed response in the memory store does not unpack".to_owned())
}

/// A record as the memory store holds it (the key is the map's): the fingerprint in its
/// stored form and a finished response packed into one allocation. The maps hold it boxed:
/// a hash table keeps up to half its slots empty, and an empty slot then costs a pointer
/// instead of a whole entry (measured in BENCHMARKS.md).
#[derive(Debug)]
struct Entry {
    fingerprint: [u8; 33],
    state: EntryState,
    created_at: SystemTime,
    expires_at: SystemTime,
}

#[derive(Debug)]
enum EntryState {
    InProgress {
        token: LeaseToken,
        locked_until: SystemTime,
    },
    Done {
        outcome: Packed,
        completed_at: SystemTime,
    },
}

impl Entry {
    fn fingerprint(&self) -> Fingerprint {
        Fingerprint::from_parts(self.fingerprint[0], {
            let mut digest = [0; 32];
            digest.copy_from_slice(&self.fingerprint[1..]);
            digest
        })
    }

    /// The public form; `None` if a packed response does not unpack (it always does: this
    /// store packed it).
    fn to_record(&self, key: &RecordKey) -> Option<Record> {
        Some(Record {
            key: key.clone(),
            fingerprint: self.fingerprint(),
            state: match &self.state {
                EntryState::InProgress {
                    token,
                    locked_until,
                } => RecordState::InProgress {
                    token: *token,
                    locked_until: *locked_until,
                },
                EntryState::Done {
                    outcome,
                    completed_at,
                } => RecordState::Done {
                    outcome: outcome.unpack()?,
                    completed_at: *completed_at,
                },
            },
            created_at: self.created_at,
            expires_at: self.expires_at,
        })
    }
}

/// A [`StoredOutcome`] in one allocation: a stored response is its status (2 bytes), the
/// length of its encoded headers (4 bytes, [`StoredResponse::encode_headers`]), the headers
/// and the body; an oversized outcome is kept as it is.
#[derive(Debug)]
enum Packed {
    Response(Box<[u8]>),
    Oversized { status: u16, size: u64 },
}

impl Packed {
    fn pack(outcome: &StoredOutcome) -> Self {
        match outcome {
            StoredOutcome::Response(r) => {
                let headers = r.encode_headers();
                let mut out = Vec::with_capacity(6 + headers.len() + r.body.len());
                out.extend_from_slice(&r.status.to_be_bytes());
                out.extend_from_slice(&(headers.len() as u32).to_be_bytes());
                out.extend_from_slice(&headers);
                out.extend_from_slice(&r.body);
                Packed::Response(out.into_boxed_slice())
            }
            StoredOutcome::Oversized { status, size } => Packed::Oversized {
                status: *status,
                size: *size,
            },
        }
    }

    fn unpack(&self) -> Option<StoredOutcome> {
        match self {
            Packed::Response(bytes) => {
                let status = u16::from_be_bytes(bytes.get(..2)?.try_into().ok()?);
                let len = u32::from_be_bytes(bytes.get(2..6)?.try_into().ok()?) as usize;
                let headers = StoredResponse::decode_headers(bytes.get(6..6 + len)?)?;
                Some(StoredOutcome::Response(StoredResponse {
                    status,
                    headers,
                    body: bytes.get(6 + len..)?.to_vec(),
                }))
            }
            Packed::Oversized { status, size } => Some(StoredOutcome::Oversized {
                status: *status,
                size: *size,
            }),
        }
    }
}

/// `t + d`, saturating far in the future instead of panicking on absurd durations.
fn later(t: SystemTime, d: Duration) -> SystemTime {
    const CENTURY: Duration = Duration::from_secs(100 * 365 * 86_400);
    t.checked_add(d)
        .or_else(|| t.checked_add(CENTURY))
        .unwrap_or(t)
}

#[async_trait::async_trait]
impl Store for MemoryStore {
    async fn claim(&self, req: ClaimRequest<'_>) -> Result<ClaimOutcome, StoreError> {
        let refused = |refused| match refused {
            Refused::Full => StoreError::Capacity {
                max_entries: self.inner.max_entries,
            },
            Refused::ScopeFull => StoreError::ScopeCapacity {
                max_per_scope: self.inner.max_per_scope,
            },
            Refused::Corrupt => corrupt(),
        };
        match self.try_claim(&req) {
            Ok(outcome) => Ok(outcome),
            Err(Refused::Full | Refused::ScopeFull) if self.purge_for_room() => {
                self.try_claim(&req).map_err(refused)
            }
            Err(other) => Err(refused(other)),
        }
    }

    async fn complete(
        &self,
        key: &RecordKey,
        token: LeaseToken,
        outcome: &StoredOutcome,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        self.fenced(key, token, |map, now| {
            if let Some(rec) = map.get_mut(key) {
                rec.state = EntryState::Done {
                    outcome: Packed::pack(outcome),
                    completed_at: now,
                };
                rec.expires_at = rec.expires_at.max(later(now, ttl));
            }
        })
    }

    async fn release(&self, key: &RecordKey, token: LeaseToken) -> Result<(), StoreError> {
        self.fenced(key, token, |map, _| {
            if map.remove(key).is_some() {
                self.inner.len.fetch_sub(1, Ordering::Relaxed);
                self.unreserve_in_scope(&key.scope);
            }
        })
    }

    async fn extend(
        &self,
        key: &RecordKey,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<SystemTime, StoreError> {
        self.fenced(key, token, |map, now| {
            let until = later(now, lease);
            if let Some(rec) = map.get_mut(key) {
                rec.state = EntryState::InProgress {
                    token,
                    locked_until: until,
                };
                rec.expires_at = rec.expires_at.max(until);
            }
            until
        })
    }

    async fn purge_expired(&self, batch: usize) -> Result<u64, StoreError> {
        Ok(self.purge(batch))
    }

    async fn delete(&self, key: &RecordKey, force: bool) -> Result<Deleted, StoreError> {
        let mut map = self.shard(key);
        let Some(entry) = map.get(key) else {
            return Ok(Deleted::Absent);
        };
        let record = entry.to_record(key).ok_or_else(corrupt)?;
        let in_progress = matches!(entry.state, EntryState::InProgress { .. });
        // An expired record is deleted whatever its state: it is absent to claims already.
        if in_progress && !force && entry.expires_at > self.now() {
            return Ok(Deleted::InProgress(record));
        }
        map.remove(key);
        self.inner.len.fetch_sub(1, Ordering::Relaxed);
        self.unreserve_in_scope(&key.scope);
        Ok(Deleted::Deleted(record))
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        let now = self.now();
        match self.shard(key).get(key).filter(|r| r.expires_at > now) {
            None => Ok(None),
            Some(entry) => entry.to_record(key).map(Some).ok_or_else(corrupt),
        }
    }
}
