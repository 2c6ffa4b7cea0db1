//! The in-memory store: the embedded default for one process.

use crate::clock::{Clock, SystemClock};
use crate::fingerprint::Fingerprint;
use crate::scope::Scope;
use crate::store::fence::{Lease, LeaseToken};
use crate::store::record::{Record, RecordKey, RecordState, StoredOutcome, StoredResponse};
use crate::store::{ClaimOutcome, ClaimRequest, Deleted, Store, StoreError};
use hashbrown::HashTable;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

const MIB: u64 = 1024 * 1024;

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
/// namespaces shared by every caller, unscoped routes' ([`Scope::unscoped`]) and unscoped
/// idempotent functions' (queue consumers deduplicating by message id), have no per-scope
/// bound; `max_entries` bounds them. A namespace is shared because it was built so, never
/// because of how its text reads: a caller whose identity is spelled like a function's
/// namespace is one caller, bounded like any other.
///
/// The per-scope bounds are ceilings on *live* records, so they also limit a legitimate busy
/// caller: with the default ttl of 24 hours, a caller sending more than about 1.1 new keys a
/// second on average (100,000 a day) meets the count bound, and one whose records are larger
/// than about 335 bytes meets its byte budget sooner (records of a 200-byte body: about 56,000
/// a day, 0.65 a second). Size `max_per_scope`, `max_bytes_per_scope` (and the ttl) for your
/// busiest caller, or use a SQL store, which has no such bounds.
///
/// # Byte budgets
/// Records are also bounded by the memory they hold: at most `max_bytes` in all (default
/// 256 MiB) and `max_bytes_per_scope` per caller (default 32 MiB), so 100,000 records of a
/// 1 MiB response cannot exhaust the process. A record is charged an estimate of what it
/// holds: its scope, key, fingerprint (33 bytes), stored response (status, encoded headers and
/// body) and a fixed [`MemoryStore::RECORD_OVERHEAD`] of 272 bytes for the map slot, the entry
/// and allocator rounding. Measured (BENCHMARKS.md's footprint bench): a million finished
/// records of a 200-byte body are charged 600 bytes each and take 600 bytes each resident
/// (572.2 MiB charged, 572.6 MiB resident). The defaults suit a process of 1 GiB: the store
/// takes at most a quarter of it, leaving the rest to the application and to the requests and
/// responses in flight (up to `max_request` and `max_response` each); one caller takes at most
/// an eighth of the store (32 responses of 1 MiB, or about 56,000 records of a 200-byte body),
/// so at least eight callers at their budget are needed to fill it. With the defaults the
/// byte budget, not `max_entries`, is what bounds a store of small records (about 447,000 of
/// them). Raise both for a larger process.
///
/// A claim is charged its record and the most its outcome may store, the route's
/// `max_response` ([`ClaimRequest::max_stored`]), reserved when the claim is admitted, and
/// refused like the count bound when that does not fit ([`StoreError::ScopeByteCapacity`],
/// [`StoreError::ByteCapacity`]; HTTP: 503 with `Retry-After`); so is a claim taking over an
/// expired record. `complete` settles the reservation: the record is then charged the
/// response it stored (the rest given back), and `release` gives it all back. So claims in
/// flight can never together store past a budget: 300 concurrent requests of one caller for
/// 1 MiB responses are admitted only as far as its 32 MiB go (31 of them), whatever they
/// answer, and the store never holds more than its budget. Neither budget ever turns a
/// response into the "not stored" marker (that marker, a 410 on retry, is only for a
/// response over the route's `max_response`): a response always fits in the room its claim
/// reserved.
///
/// A response larger than its reservation (its headers, which `max_response` does not count;
/// or a caller of the store that reserved less than it stores) is stored and charged all the
/// same, even past a budget, since its bytes are in memory already and refusing the complete
/// would let a retry run the handler again; while the bytes charged are over a budget, that
/// budget refuses every new claim. A reservation larger than a whole budget (a route whose
/// `max_response` exceeds `max_bytes_per_scope`) is refused at every claim: keep
/// `max_bytes_per_scope` well above the routes' `max_response`.
///
/// A scope's text is held twice: in each of its records' keys, charged with each record, and
/// once in its usage entry, charged with its first record ([`MemoryStore::SCOPE_OVERHEAD`]
/// and the text) and given back with its last.
///
/// # Time
/// Leases and expiry are measured on a monotonic clock ([`Clock::instant`]), so a wall clock
/// stepped backwards never extends a lease and one stepped forwards never ends it early nor
/// expires records. Record times shown by [`get`](Store::get) and
/// [`delete`](Store::delete) are wall-clock times ([`Clock::now`]): `created_at` and
/// `completed_at` as they were read then; the lease end and expiry (monotonic instants) on the
/// wall time the store read when it was built plus the monotonic time since, so the same
/// lease end reads the same every time (a wall clock stepped since then does not move them).
///
/// ```
/// use idempotent_core::MemoryStore;
/// let store = MemoryStore::builder()
///     .max_entries(10_000)
///     .max_per_scope(1_000)
///     .max_bytes(64 * 1024 * 1024)
///     .max_bytes_per_scope(4 * 1024 * 1024)
///     .build();
/// # let _ = store;
/// ```
#[derive(Debug, Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

/// One shard's records. An operation hashes its key once ([`MemoryStore::shard`] picks the
/// shard from that hash) and finds the record with the same hash: a `HashMap` would hash it
/// again for every lookup, four times in a claim of a new key.
#[derive(Debug, Default)]
struct Shard(HashTable<Slot>);

/// A record in its shard's table, with its key's hash kept beside it. When the table grows,
/// or rehashes in place after removals, it moves slots by that hash: it never reads the key's
/// two strings again (a cache miss each, on a table larger than the cache) nor hashes them
/// (`perf`: 3.3 % of a server's time under first executions went to rehashing keys). A slot
/// is 8 bytes more for it.
#[derive(Debug)]
struct Slot {
    hash: u64,
    key: RecordKey,
    entry: Box<Entry>,
}

impl Slot {
    /// Whether this slot holds `k`; the hash first, so a slot whose 7-bit tag matched by
    /// chance is passed over without reading its key.
    #[inline]
    fn holds(&self, k: Hashed<'_>) -> bool {
        self.hash == k.hash && self.key == *k.key
    }
}

/// A record's key with its hash under the store's hasher.
#[derive(Clone, Copy)]
struct Hashed<'a> {
    key: &'a RecordKey,
    hash: u64,
}

impl Shard {
    #[inline]
    fn get(&self, k: Hashed<'_>) -> Option<&Entry> {
        self.0.find(k.hash, |s| s.holds(k)).map(|s| &*s.entry)
    }

    #[inline]
    fn get_mut(&mut self, k: Hashed<'_>) -> Option<&mut Box<Entry>> {
        self.0
            .find_mut(k.hash, |s| s.holds(k))
            .map(|s| &mut s.entry)
    }

    fn remove_entry(&mut self, k: Hashed<'_>) -> Option<(RecordKey, Box<Entry>)> {
        let found = self.0.find_entry(k.hash, |s| s.holds(k)).ok()?;
        let Slot { key, entry, .. } = found.remove().0;
        Some((key, entry))
    }

    /// Inserts the record of a key this shard does not hold (checked under its lock).
    fn insert_new(&mut self, k: Hashed<'_>, entry: Box<Entry>) {
        let slot = Slot {
            hash: k.hash,
            key: k.key.clone(),
            entry,
        };
        self.0.insert_unique(k.hash, slot, |s| s.hash);
    }
}

#[derive(Debug)]
struct Inner {
    shards: Box<[Mutex<Shard>]>,
    hasher: RandomState,
    len: AtomicUsize,
    max_entries: usize,
    /// Bytes charged for every record held ([`MemoryStore::charge`]); over `max_bytes` after
    /// a response was stored past it, and new records are refused while it is.
    bytes: AtomicU64,
    max_bytes: u64,
    /// Records and bytes held per scope, sharded by the scope's hash (taken after a record
    /// shard's lock, never before, and never across another lock).
    per_scope: Box<[Mutex<Usages>]>,
    max_per_scope: usize,
    max_bytes_per_scope: u64,
    /// When the last purge for room ran (monotonic; `None`: never).
    last_room_purge: Mutex<Option<Instant>>,
    /// Wall and monotonic time read together when the store was built (see `Now::anchor`).
    anchor: (SystemTime, Instant),
    clock: Arc<dyn Clock>,
    /// Wakes requests waiting on a record (in process: the store lives in one).
    changes: super::Changes,
}

/// One shard of the scopes' usage, found by the scope's hash under the store's hasher (taken
/// once per lookup of a scope's usage, for the shard and the table alike; once for both of a
/// completion's). Each entry keeps that hash, as a record's [`Slot`] does, so the table grows
/// and rehashes without hashing scopes again.
#[derive(Debug, Default)]
struct Usages(HashTable<(u64, Scope, Usage)>);

/// A scope's entry in its locked [`Usages`] shard, present or not.
struct ScopeUsage<'a> {
    usages: MutexGuard<'a, Usages>,
    scope: &'a Scope,
    hash: u64,
}

impl ScopeUsage<'_> {
    fn get(&self) -> Option<&Usage> {
        let is = scope_is(self.hash, self.scope);
        self.usages.0.find(self.hash, is).map(|(_, _, u)| u)
    }

    fn get_mut(&mut self) -> Option<&mut Usage> {
        let is = scope_is(self.hash, self.scope);
        self.usages.0.find_mut(self.hash, is).map(|(_, _, u)| u)
    }

    /// Adds the usage of a scope its shard does not hold (checked under its lock).
    fn insert_new(&mut self, usage: Usage) {
        let entry = (self.hash, self.scope.clone(), usage);
        self.usages
            .0
            .insert_unique(self.hash, entry, |(h, _, _)| *h);
    }

    fn remove(&mut self) {
        let is = scope_is(self.hash, self.scope);
        if let Ok(found) = self.usages.0.find_entry(self.hash, is) {
            found.remove();
        }
    }
}

/// Whether an entry of a [`Usages`] table is `scope`'s, whose hash is `hash`; the hash first
/// (see [`Slot::holds`]).
fn scope_is(hash: u64, scope: &Scope) -> impl Fn(&(u64, Scope, Usage)) -> bool {
    move |(h, s, _)| *h == hash && s == scope
}

/// What one scope holds.
#[derive(Debug, Default)]
struct Usage {
    records: usize,
    /// Over `max_bytes_per_scope` after a response was stored past it; the scope's new
    /// records are refused while it is.
    bytes: u64,
}

/// Builds a [`MemoryStore`].
#[derive(Debug)]
pub struct MemoryStoreBuilder {
    max_entries: usize,
    max_per_scope: usize,
    max_bytes: u64,
    max_bytes_per_scope: u64,
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

    /// Upper bound on the bytes all records hold, as the store estimates them (default
    /// 256 MiB; see [`MemoryStore`]'s "Byte budgets"). A budget smaller than one record
    /// without its response (305 bytes plus its scope and key) refuses every claim.
    #[must_use]
    pub fn max_bytes(mut self, bytes: u64) -> Self {
        self.max_bytes = bytes;
        self
    }

    /// Upper bound on the bytes one scope's records hold (default 32 MiB), so one caller
    /// cannot fill the store's memory for everyone. The unscoped namespace is bounded by
    /// [`max_bytes`](Self::max_bytes) alone.
    #[must_use]
    pub fn max_bytes_per_scope(mut self, bytes: u64) -> Self {
        self.max_bytes_per_scope = bytes;
        self
    }

    /// The clock leases and expiry are measured with (default: the system's clocks; leases
    /// and expiry use its monotonic reading, see [`Clock`]).
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
                shards: (0..n).map(|_| Mutex::default()).collect(),
                hasher: RandomState::new(),
                len: AtomicUsize::new(0),
                max_entries: self.max_entries,
                bytes: AtomicU64::new(0),
                max_bytes: self.max_bytes,
                per_scope: (0..n).map(|_| Mutex::default()).collect(),
                max_per_scope: self.max_per_scope,
                max_bytes_per_scope: self.max_bytes_per_scope,
                last_room_purge: Mutex::new(None),
                anchor: (self.clock.now(), self.clock.instant()),
                clock: self.clock,
                changes: super::Changes::in_process(std::time::Duration::from_secs(1)),
            }),
        }
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

/// One reading of the store's clock.
#[derive(Debug, Clone, Copy)]
struct Now {
    /// Wall time, for what records show.
    wall: SystemTime,
    /// Monotonic time, for leases and expiry.
    mono: Instant,
    /// The store's one pairing of the two clocks, read when it was built: a monotonic time is
    /// shown as a wall time through it, so the same lease end reads the same every time.
    anchor: (SystemTime, Instant),
}

impl Now {
    /// The wall-clock time `t` (monotonic) stands for, on the store's anchor.
    fn wall_of(self, t: Instant) -> SystemTime {
        let (wall, mono) = self.anchor;
        if t >= mono {
            wall_later(wall, t - mono)
        } else {
            wall.checked_sub(mono - t).unwrap_or(SystemTime::UNIX_EPOCH)
        }
    }
}

impl MemoryStore {
    /// Bytes charged per record on top of its scope, key, fingerprint and stored response:
    /// the map slot, the boxed entry and allocator rounding (see "Byte budgets").
    pub const RECORD_OVERHEAD: u64 = 272;

    /// Bytes charged per scope that holds records, on top of its text: its usage entry (the
    /// scope's hash, a copy of the scope and its counts, 48 bytes) and allocator rounding. A
    /// scope's text is kept twice, in each record's key and once in its usage; both are
    /// charged, the first with each record and the second with the scope's first record.
    pub const SCOPE_OVERHEAD: u64 = 64;

    /// A store with the defaults (1,000,000 records, 100,000 per scope, 256 MiB, 32 MiB per
    /// scope, system clock).
    pub fn new() -> Self {
        Self::builder().build()
    }

    /// Starts a builder.
    pub fn builder() -> MemoryStoreBuilder {
        MemoryStoreBuilder {
            max_entries: 1_000_000,
            max_per_scope: 100_000,
            max_bytes: 256 * MIB,
            max_bytes_per_scope: 32 * MIB,
            clock: Arc::new(SystemClock),
        }
    }

    /// Records held, expired ones included until purged.
    pub fn len(&self) -> usize {
        self.inner.len.load(Ordering::Relaxed)
    }

    /// Bytes charged for the records held, expired ones included until purged (an estimate
    /// of the memory they hold; see "Byte budgets").
    pub fn bytes(&self) -> u64 {
        self.inner.bytes.load(Ordering::Relaxed)
    }

    /// Whether no record is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The shard of `key`, locked, and the key with its hash to look it up there.
    fn shard<'k>(&self, key: &'k RecordKey) -> (MutexGuard<'_, Shard>, Hashed<'k>) {
        let hash = self.inner.hasher.hash_one(key);
        // The shard from bits the table does not use for the slot (the low ones) or the tag
        // (the top seven), so the keys of one shard still spread over its table.
        let i = (hash >> 32) as usize & (self.inner.shards.len() - 1);
        // A poisoned shard only means a panic elsewhere mid-operation; every operation leaves
        // the map consistent before it can panic, so keep going.
        let shard = self.inner.shards[i]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        (shard, Hashed { key, hash })
    }

    fn now(&self) -> Now {
        Now {
            wall: self.inner.clock.now(),
            mono: self.inner.clock.instant(),
            anchor: self.inner.anchor,
        }
    }

    /// What a record of `key` is charged without its response.
    fn base_charge(key: &RecordKey) -> u64 {
        Self::RECORD_OVERHEAD + (key.scope.as_str().len() + key.key.as_str().len() + 33) as u64
    }

    /// What the record `entry` of `key` is charged.
    fn charge(key: &RecordKey, entry: &Entry) -> u64 {
        Self::base_charge(key) + entry.outcome_bytes()
    }

    /// Counts a new record of `charge` bytes for `key`: in the store, and in its scope unless
    /// that is a shared namespace (`counted` false).
    fn admit(&self, key: &RecordKey, charge: u64, counted: bool) -> Result<(), Refused> {
        let inner = &*self.inner;
        // Reserve first, so claims racing on other shards cannot overshoot.
        let max = inner.max_entries;
        inner
            .len
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .map_err(|_| Refused::Full)?;
        self.grow(&key.scope, counted, charge).inspect_err(|_| {
            inner.len.fetch_sub(1, Ordering::AcqRel);
        })
    }

    /// Charges a new record of `bytes` to the store and, if `counted`, to `scope`. Refused,
    /// with nothing charged, when the bytes charged would then be over a budget (so always
    /// while a budget is over: a response may be stored past it, see "Byte budgets"), or when
    /// the scope holds `max_per_scope` records.
    fn grow(&self, scope: &Scope, counted: bool, bytes: u64) -> Result<(), Refused> {
        let inner = &*self.inner;
        let max = inner.max_bytes;
        inner
            .bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |b| {
                b.checked_add(bytes).filter(|&total| total <= max)
            })
            .map_err(|_| Refused::BytesFull)?;
        if !counted {
            return Ok(());
        }
        let mut usages = self.scope_usage(scope);
        // Looked up by reference: the scope is cloned only for its first record, and that
        // copy (the usage's own) is charged with it, to the store and the scope alike.
        let (records, held, own) = usages.get().map_or_else(
            || (0, 0, Self::usage_charge(scope)),
            |usage| (usage.records, usage.bytes, 0),
        );
        let refused = if records >= inner.max_per_scope {
            Some(Refused::ScopeFull)
        } else if held
            .checked_add(bytes)
            .and_then(|b| b.checked_add(own))
            .is_none_or(|b| b > inner.max_bytes_per_scope)
        {
            Some(Refused::ScopeBytesFull)
        } else if own > 0
            && inner
                .bytes
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |b| {
                    b.checked_add(own).filter(|&total| total <= max)
                })
                .is_err()
        {
            Some(Refused::BytesFull)
        } else {
            None
        };
        if let Some(refused) = refused {
            drop(usages);
            inner.bytes.fetch_sub(bytes, Ordering::AcqRel);
            return Err(refused);
        }
        match usages.get_mut() {
            Some(usage) => {
                usage.bytes += bytes;
                usage.records += 1;
            }
            None => usages.insert_new(Usage {
                records: 1,
                bytes: bytes + own,
            }),
        }
        Ok(())
    }

    /// Charges the response of `bytes` of a record being completed to the store and, if
    /// `counted`, to `scope`, whatever the budgets: those bytes are in memory already, and
    /// turning them away would cost the caller a replayable response. A budget this takes
    /// past its bound refuses new records until records go ("Byte budgets"); logged once per
    /// crossing.
    fn charge_response(&self, scope: &Scope, scope_hash: u64, counted: bool, bytes: u64) {
        let inner = &*self.inner;
        let before = inner.bytes.fetch_add(bytes, Ordering::AcqRel);
        let mut crossed = None;
        if before <= inner.max_bytes && before.saturating_add(bytes) > inner.max_bytes {
            crossed = Some(("max_bytes", inner.max_bytes));
        }
        if counted {
            // A counted record keeps its scope's usage alive (records >= 1).
            if let Some(usage) = self.scope_usage_at(scope, scope_hash).get_mut() {
                let max = inner.max_bytes_per_scope;
                if usage.bytes <= max && usage.bytes.saturating_add(bytes) > max {
                    crossed = crossed.or(Some(("max_bytes_per_scope", max)));
                }
                usage.bytes = usage.bytes.saturating_add(bytes);
            }
        }
        if let Some((budget, max)) = crossed {
            tracing::warn!(
                budget,
                max,
                size = bytes,
                "idempotency: a response took the memory store past its byte budget; it is stored and replayed, and new keys under that budget are refused (503) until records are released, deleted or expire"
            );
        }
    }

    /// Gives back `bytes` (and a record, if `gone`) charged to the store and, if `counted`,
    /// to `scope`.
    fn shrink(&self, scope: &Scope, counted: bool, bytes: u64, gone: bool) {
        let inner = &*self.inner;
        if gone {
            inner.len.fetch_sub(1, Ordering::AcqRel);
        }
        if bytes == 0 && !gone {
            return;
        }
        inner.bytes.fetch_sub(bytes, Ordering::AcqRel);
        if !counted {
            return;
        }
        let mut usages = self.scope_usage(scope);
        if let Some(usage) = usages.get_mut() {
            usage.bytes = usage.bytes.saturating_sub(bytes);
            if gone {
                usage.records = usage.records.saturating_sub(1);
                if usage.records == 0 {
                    // What is left is the usage's own copy of the scope: given back with it.
                    inner.bytes.fetch_sub(usage.bytes, Ordering::AcqRel);
                    usages.remove();
                }
            }
        }
    }

    /// What a scope's usage entry is charged, while the scope holds records: its slot and
    /// its own copy of the scope (the records' keys hold theirs).
    fn usage_charge(scope: &Scope) -> u64 {
        Self::SCOPE_OVERHEAD + scope.as_str().len() as u64
    }

    /// Gives back everything the removed record `entry` of `key` was charged.
    fn forget(&self, key: &RecordKey, entry: &Entry) {
        self.shrink(&key.scope, entry.counted, Self::charge(key, entry), true);
    }

    /// The usage of `scope`, its shard locked; the scope is hashed once for the shard and
    /// every lookup in it.
    fn scope_usage<'a>(&'a self, scope: &'a Scope) -> ScopeUsage<'a> {
        self.scope_usage_at(scope, self.scope_hash(scope))
    }

    /// `scope`'s hash under the store's hasher, for [`scope_usage_at`](Self::scope_usage_at).
    fn scope_hash(&self, scope: &Scope) -> u64 {
        self.inner.hasher.hash_one(scope)
    }

    /// [`scope_usage`](Self::scope_usage) with the scope's hash taken already.
    fn scope_usage_at<'a>(&'a self, scope: &'a Scope, hash: u64) -> ScopeUsage<'a> {
        // As in `shard`: bits the table does not use for the slot or the tag.
        let i = (hash >> 32) as usize & (self.inner.per_scope.len() - 1);
        let usages = self.inner.per_scope[i]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        ScopeUsage {
            usages,
            scope,
            hash,
        }
    }

    /// What a claim reserves for its outcome: its `max_stored`, but never more than a budget
    /// holds (a route whose `max_response` is larger than `max_bytes_per_scope` would
    /// otherwise be refused at every claim; its larger responses are charged when stored).
    fn reservation(&self, req: &ClaimRequest<'_>) -> u64 {
        let budget = if req.key.scope.is_shared() {
            self.inner.max_bytes
        } else {
            self.inner.max_bytes_per_scope.min(self.inner.max_bytes)
        };
        req.max_stored.min(budget / 2)
    }

    /// A record's outcome charged `new` bytes instead of `old` (a reservation settled by the
    /// response stored, or replaced by a take-over's): the difference is given back, or
    /// charged whatever the budgets (see [`charge_response`](Self::charge_response)).
    fn settle(&self, scope: &Scope, scope_hash: u64, counted: bool, old: u64, new: u64) {
        if new > old {
            self.charge_response(scope, scope_hash, counted, new - old);
        } else if old > new {
            self.shrink(scope, counted, old - new, false);
        }
    }

    /// Purges expired records to make room, unless that ran less than a second ago (by the
    /// store's monotonic clock). Whether it ran.
    fn purge_for_room(&self) -> bool {
        let now = self.now().mono;
        {
            let mut last = self
                .inner
                .last_room_purge
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            // Due when it never ran or a second has passed.
            let due = last
                .is_none_or(|last| now.saturating_duration_since(last) >= Duration::from_secs(1));
            if !due {
                return false;
            }
            *last = Some(now);
        }
        self.purge(usize::MAX);
        true
    }

    fn purge(&self, batch: usize) -> u64 {
        let now = self.now().mono;
        let mut purged = 0_u64;
        let mut left = batch;
        for shard in self.inner.shards.iter() {
            if left == 0 {
                break;
            }
            let mut map = shard.lock().unwrap_or_else(|e| e.into_inner());
            map.0.retain(|slot| {
                if left > 0 && slot.entry.expires_at <= now {
                    left -= 1;
                    purged += 1;
                    self.forget(&slot.key, &slot.entry);
                    return false;
                }
                // A lease that ran out (its execution crashed, or gave up on its complete)
                // gives its reservation back: the record stays until it expires, or a retry
                // takes it over (and reserves again), but holds no room for an outcome nobody
                // may store any more without a take-over.
                if let EntryState::InProgress {
                    locked_until,
                    reserved,
                    ..
                } = &mut slot.entry.state
                    && *locked_until <= now
                    && *reserved > 0
                {
                    self.shrink(&slot.key.scope, slot.entry.counted, *reserved, false);
                    *reserved = 0;
                }
                true
            });
        }
        purged
    }

    fn try_claim(
        &self,
        req: &ClaimRequest<'_>,
    ) -> Result<(ClaimOutcome, Option<Duration>), Refused> {
        let now = self.now();
        let (mut map, key) = self.shard(req.key);
        let fresh = |took_over, counted| {
            let token = LeaseToken::generate();
            let locked_until = later(now.mono, req.lease);
            let lease = Lease {
                token,
                locked_until: now.wall_of(locked_until),
                took_over,
            };
            let record = Entry {
                // As a SQL store keeps it: version and digest.
                fingerprint: req.fingerprint.to_stored(),
                counted,
                state: EntryState::InProgress {
                    token,
                    locked_until,
                    reserved: self.reservation(req),
                },
                created_at: now.wall,
                expires_at: later(now.mono, req.lease.saturating_add(req.ttl)),
            };
            (lease, record)
        };
        // Past its ttl, a record counts as absent, whatever its fingerprint: it is purged here
        // and the key claimed as a new record (a take-over), so that claim is bounded as any
        // new record is (refused while a byte budget is over).
        let expired = map.get(key).is_some_and(|rec| rec.expires_at <= now.mono);
        if expired && let Some((key, entry)) = map.remove_entry(key) {
            self.forget(&key, &entry);
        }
        match map.get_mut(key) {
            None => {
                let counted = !req.key.scope.is_shared();
                // The record and what its outcome may store, reserved now: claims in flight
                // can never together store past a budget.
                let charge = Self::base_charge(req.key).saturating_add(self.reservation(req));
                self.admit(req.key, charge, counted)?;
                let (lease, record) = fresh(expired, counted);
                map.insert_new(key, Box::new(record));
                Ok((ClaimOutcome::Claimed(lease), None))
            }
            Some(rec) if !req.fingerprint.matches_stored(&rec.fingerprint()) => {
                let in_progress = matches!(rec.state, EntryState::InProgress { .. });
                Ok((ClaimOutcome::Mismatch { in_progress }, None))
            }
            Some(rec) => match &rec.state {
                EntryState::Done { outcome, .. } => match outcome.unpack() {
                    // Not reported for a record of another fingerprint version (matched by
                    // key alone), which a cache would match by digest.
                    Some(outcome) => Ok((
                        ClaimOutcome::Replay(outcome),
                        (rec.fingerprint().version() == req.fingerprint.version())
                            .then(|| rec.expires_at.saturating_duration_since(now.mono)),
                    )),
                    None => Err(Refused::Corrupt),
                },
                EntryState::InProgress { locked_until, .. } if *locked_until > now.mono => {
                    let retry_after = locked_until.saturating_duration_since(now.mono);
                    Ok((ClaimOutcome::InProgress { retry_after }, None))
                }
                EntryState::InProgress { reserved, .. } => {
                    // Lease ran out, same fingerprint: take over with a new token, and the
                    // new claim's reservation in place of the old one's.
                    let (old, new) = (*reserved, self.reservation(req));
                    let (lease, mut record) = fresh(true, rec.counted);
                    record.created_at = rec.created_at;
                    let counted = rec.counted;
                    **rec = record;
                    self.settle(
                        &req.key.scope,
                        self.scope_hash(&req.key.scope),
                        counted,
                        old,
                        new,
                    );
                    Ok((ClaimOutcome::Claimed(lease), None))
                }
            },
        }
    }

    /// Runs `f` on the live, in-progress record held by `token`, or fails with `StaleLease`.
    fn fenced<T>(
        &self,
        key: &RecordKey,
        token: LeaseToken,
        f: impl FnOnce(&mut Shard, Hashed<'_>, Now) -> T,
    ) -> Result<T, StoreError> {
        let now = self.now();
        let (mut map, key) = self.shard(key);
        match map.get(key) {
            Some(Entry {
                state: EntryState::InProgress { token: held, .. },
                expires_at,
                ..
            }) if *held == token && *expires_at > now.mono => Ok(f(&mut map, key, now)),
            _ => Err(StoreError::StaleLease),
        }
    }
}

/// Why [`MemoryStore::try_claim`] did not answer.
#[derive(Debug)]
enum Refused {
    /// No room for a new record.
    Full,
    /// No room for a new record of this scope.
    ScopeFull,
    /// No room in the store's byte budget.
    BytesFull,
    /// No room in this scope's byte budget.
    ScopeBytesFull,
    /// A packed response did not unpack (cannot happen: this store packed it).
    Corrupt,
}

fn corrupt() -> StoreError {
    StoreError::Corrupt("a packed response in the memory store does not unpack".to_owned())
}

/// A record as the memory store holds it (the key is the map's): the fingerprint in its
/// stored form and a finished response packed into one allocation. The maps hold it boxed:
/// a hash table keeps up to half its slots empty, and an empty slot then costs a pointer
/// instead of a whole entry (measured in BENCHMARKS.md). Leases and expiry are monotonic
/// instants; the times only shown are wall-clock.
#[derive(Debug)]
struct Entry {
    fingerprint: [u8; 33],
    /// Whether the record counts towards its scope's bounds: its scope was not a shared
    /// namespace when it was first claimed (the record stays charged to that claim's scope).
    counted: bool,
    state: EntryState,
    created_at: SystemTime,
    expires_at: Instant,
}

#[derive(Debug)]
enum EntryState {
    InProgress {
        token: LeaseToken,
        locked_until: Instant,
        /// The bytes reserved for its outcome ([`ClaimRequest::max_stored`]), charged while
        /// it runs and settled when it completes.
        reserved: u64,
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

    /// The bytes its outcome is charged: those reserved while in progress, its packed
    /// response once done (0 for the marker).
    fn outcome_bytes(&self) -> u64 {
        match &self.state {
            EntryState::InProgress { reserved, .. } => *reserved,
            EntryState::Done { outcome, .. } => outcome.bytes(),
        }
    }

    /// The public form, its lease end and expiry as wall times on the store's anchor;
    /// `None` if a packed response does not unpack (it always does: this store packed it).
    fn to_record(&self, key: &RecordKey, now: Now) -> Option<Record> {
        Some(Record {
            key: key.clone(),
            fingerprint: self.fingerprint(),
            state: match &self.state {
                EntryState::InProgress {
                    token,
                    locked_until,
                    ..
                } => RecordState::InProgress {
                    token: *token,
                    locked_until: now.wall_of(*locked_until),
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
            expires_at: now.wall_of(self.expires_at),
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
                // Encoded in place, not through a buffer of their own.
                let headers = r.encoded_headers_len();
                let mut out = Vec::with_capacity(6 + headers + r.body.len());
                out.extend_from_slice(&r.status.to_be_bytes());
                out.extend_from_slice(&(headers as u32).to_be_bytes());
                r.encode_headers_into(&mut out);
                out.extend_from_slice(&r.body);
                Packed::Response(out.into_boxed_slice())
            }
            StoredOutcome::Oversized { status, size } => Packed::Oversized {
                status: *status,
                size: *size,
            },
        }
    }

    /// The bytes it holds on the heap (0 for the marker).
    fn bytes(&self) -> u64 {
        match self {
            Packed::Response(bytes) => bytes.len() as u64,
            Packed::Oversized { .. } => 0,
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

const CENTURY: Duration = Duration::from_secs(100 * 365 * 86_400);

/// `t + d` (monotonic), saturating far in the future instead of panicking on absurd
/// durations.
fn later(t: Instant, d: Duration) -> Instant {
    t.checked_add(d)
        .or_else(|| t.checked_add(CENTURY))
        .unwrap_or(t)
}

/// `t + d` (wall clock), saturating far in the future instead of panicking.
fn wall_later(t: SystemTime, d: Duration) -> SystemTime {
    t.checked_add(d)
        .or_else(|| t.checked_add(CENTURY))
        .unwrap_or(t)
}

impl MemoryStore {
    /// The claim, with a replayed record's remaining life (`Store::claim_with_expiry`).
    fn claim_now(
        &self,
        req: &ClaimRequest<'_>,
    ) -> Result<(ClaimOutcome, Option<Duration>), StoreError> {
        let refused = |refused| match refused {
            Refused::Full => StoreError::Capacity {
                max_entries: self.inner.max_entries,
            },
            Refused::ScopeFull => StoreError::ScopeCapacity {
                max_per_scope: self.inner.max_per_scope,
            },
            Refused::BytesFull => StoreError::ByteCapacity {
                max_bytes: self.inner.max_bytes,
            },
            Refused::ScopeBytesFull => StoreError::ScopeByteCapacity {
                max_bytes_per_scope: self.inner.max_bytes_per_scope,
            },
            Refused::Corrupt => corrupt(),
        };
        match self.try_claim(req) {
            Ok(outcome) => Ok(outcome),
            Err(Refused::Corrupt) => Err(corrupt()),
            Err(_) if self.purge_for_room() => self.try_claim(req).map_err(refused),
            Err(other) => Err(refused(other)),
        }
    }
}

#[async_trait::async_trait]
impl Store for MemoryStore {
    fn changes(&self) -> Option<&super::Changes> {
        Some(&self.inner.changes)
    }

    async fn claim(&self, req: ClaimRequest<'_>) -> Result<ClaimOutcome, StoreError> {
        self.claim_now(&req).map(|(outcome, _)| outcome)
    }

    async fn claim_with_expiry(
        &self,
        req: ClaimRequest<'_>,
    ) -> Result<(ClaimOutcome, Option<Duration>), StoreError> {
        self.claim_now(&req)
    }

    async fn complete(
        &self,
        key: &RecordKey,
        token: LeaseToken,
        outcome: &StoredOutcome,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        // Hashed once, for the charge. (No room is made first: the claim reserved it.)
        let scope_hash = self.scope_hash(&key.scope);
        self.fenced(key, token, |map, hashed, now| {
            if let Some(rec) = map.get_mut(hashed) {
                let reserved = rec.outcome_bytes();
                let packed = Packed::pack(outcome);
                // The reservation becomes the response's bytes.
                self.settle(
                    &key.scope,
                    scope_hash,
                    rec.counted,
                    reserved,
                    packed.bytes(),
                );
                rec.state = EntryState::Done {
                    outcome: packed,
                    completed_at: now.wall,
                };
                rec.expires_at = rec.expires_at.max(later(now.mono, ttl));
            }
        })
    }

    async fn release(&self, key: &RecordKey, token: LeaseToken) -> Result<(), StoreError> {
        self.fenced(key, token, |map, hashed, _| {
            if let Some((key, entry)) = map.remove_entry(hashed) {
                self.forget(&key, &entry);
            }
        })
    }

    async fn extend(
        &self,
        key: &RecordKey,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<SystemTime, StoreError> {
        self.fenced(key, token, |map, hashed, now| {
            let until = later(now.mono, lease);
            if let Some(rec) = map.get_mut(hashed) {
                if let EntryState::InProgress { locked_until, .. } = &mut rec.state {
                    *locked_until = until;
                }
                rec.expires_at = rec.expires_at.max(until);
            }
            now.wall_of(until)
        })
    }

    async fn purge_expired(&self, batch: usize) -> Result<u64, StoreError> {
        Ok(self.purge(batch))
    }

    async fn delete(&self, key: &RecordKey, force: bool) -> Result<Deleted, StoreError> {
        let now = self.now();
        let (mut map, hashed) = self.shard(key);
        let Some(entry) = map.get(hashed) else {
            return Ok(Deleted::Absent);
        };
        let record = entry.to_record(key, now).ok_or_else(corrupt)?;
        let in_progress = matches!(entry.state, EntryState::InProgress { .. });
        // An expired record is deleted whatever its state: it is absent to claims already.
        if in_progress && !force && entry.expires_at > now.mono {
            return Ok(Deleted::InProgress(record));
        }
        if let Some((key, entry)) = map.remove_entry(hashed) {
            self.forget(&key, &entry);
        }
        Ok(Deleted::Deleted(record))
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        let now = self.now();
        let (map, hashed) = self.shard(key);
        match map.get(hashed).filter(|r| r.expires_at > now.mono) {
            None => Ok(None),
            Some(entry) => entry.to_record(key, now).map(Some).ok_or_else(corrupt),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fingerprint::FingerprintInput;
    use crate::key::IdempotencyKey;

    /// Every hash kept beside a record or a scope's usage is the one the store's hasher
    /// gives its key, after the tables have grown and churned. (A lookup compares all 64
    /// bits, so a wrong kept hash loses its entry at once; placing entries by it when a
    /// table grows is what `records_stay_found_as_tables_grow_and_churn` checks.)
    #[tokio::test]
    async fn kept_hashes_are_the_keys() {
        let store = MemoryStore::new();
        let fingerprint = Fingerprint::compute(&FingerprintInput {
            method: "POST",
            path: "/kept",
            query: None,
            content_type: None,
            body: b"",
        });
        let ttl = Duration::from_secs(3600);
        let key = |i: usize| {
            RecordKey::new(
                Scope::new(format!("acct_{}", i % 700)).unwrap(),
                IdempotencyKey::parse(format!("k-{i}").as_bytes()).unwrap(),
            )
        };
        for i in 0..6_000 {
            let req = ClaimRequest {
                key: &key(i),
                fingerprint: &fingerprint,
                lease: ttl,
                ttl,
                max_stored: 0,
            };
            assert!(matches!(
                store.claim(req).await,
                Ok(ClaimOutcome::Claimed(_))
            ));
            if i % 3 == 0 {
                let gone = store.delete(&key(i / 3), true).await.unwrap();
                assert!(matches!(gone, Deleted::Deleted(_)));
            }
        }
        let hasher = &store.inner.hasher;
        let mut records = 0;
        for shard in store.inner.shards.iter() {
            for slot in shard.lock().unwrap().0.iter() {
                assert_eq!(slot.hash, hasher.hash_one(&slot.key));
                records += 1;
            }
        }
        assert_eq!(records, 4_000);
        let mut scopes = 0;
        for usages in store.inner.per_scope.iter() {
            for (hash, scope, _) in usages.lock().unwrap().0.iter() {
                assert_eq!(*hash, hasher.hash_one(scope));
                scopes += 1;
            }
        }
        assert_eq!(scopes, 700);
    }
}
