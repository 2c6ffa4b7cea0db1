//! Change notifications: what wakes a request that waits for a running duplicate's answer
//! (a route's `wait`, [`Policy::wait`](crate::engine::Policy::wait)).
//!
//! Each store owns one [`Changes`] hub. A waiter [watches](Changes::watch) its record's
//! [`ChangeId`]; whatever completes, releases or deletes a record [notifies](Changes::notify)
//! that id. Notifications only wake: a woken waiter claims again and believes the store's
//! answer, never the notification. So a notification that is lost (a listener reconnecting, a
//! message dropped) costs time, never correctness: every waiter also looks again at its store's
//! capped polling interval ([`Changes::poll_cap`]), and a hub whose listener reconnected wakes
//! every waiter ([`Changes::wake_all`]).
//!
//! Where notifications come from, per store:
//! - every store: the engine notifies its own store's hub after its own complete or release,
//!   so waiters in the same process (and over the same store value) wake at once;
//! - PostgreSQL: the completing or releasing statement sends `pg_notify` itself (delivered at
//!   its commit), and one `LISTEN` connection per store feeds the hub;
//! - Redis (standalone and Cluster): the complete and release scripts `PUBLISH`, and one
//!   subscriber connection per store feeds the hub;
//! - SQLite and MySQL/MariaDB: no cross-process notification; other processes' answers are
//!   found by polling at the store's cap (see each store's docs).

use crate::store::record::RecordKey;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;
use tokio::sync::watch;

/// A record's name in notifications: the first 16 bytes of SHA-256 over the scope's length in
/// decimal, `:`, the scope and the key, so that every instance and the database (PostgreSQL
/// computes the same in SQL) agree, and a notification carries neither the scope nor the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ChangeId([u8; 16]);

impl ChangeId {
    /// The id of `key`'s record.
    ///
    /// ```
    /// use idempotent_core::store::{ChangeId, RecordKey};
    /// use idempotent_core::{IdempotencyKey, Scope};
    /// let key = RecordKey::new(Scope::new("acct").unwrap(), IdempotencyKey::parse(b"k1").unwrap());
    /// let id = ChangeId::of(&key);
    /// assert_eq!(id.to_hex().len(), 32);
    /// assert_eq!(ChangeId::from_hex(&id.to_hex()), Some(id));
    /// ```
    pub fn of(key: &RecordKey) -> Self {
        let scope = key.scope.as_str();
        let mut hash = Sha256::new();
        hash.update(scope.len().to_string().as_bytes());
        hash.update(b":");
        hash.update(scope.as_bytes());
        hash.update(key.key.as_str().as_bytes());
        let digest = hash.finalize();
        let mut id = [0; 16];
        id.copy_from_slice(&digest[..16]);
        ChangeId(id)
    }

    /// The first 16 bytes of SHA-256 over `bytes` (a store's own name for a record).
    pub fn of_bytes(bytes: &[u8]) -> Self {
        let digest = Sha256::digest(bytes);
        let mut id = [0; 16];
        id.copy_from_slice(&digest[..16]);
        ChangeId(id)
    }

    /// Lower-case hex, 32 characters.
    pub fn to_hex(&self) -> String {
        use std::fmt::Write;
        self.0.iter().fold(String::with_capacity(32), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
    }

    /// Parses [`ChangeId::to_hex`]'s form; `None` for anything else.
    pub fn from_hex(s: &str) -> Option<Self> {
        if s.len() != 32 || !s.is_ascii() {
            return None;
        }
        let mut id = [0; 16];
        for (i, byte) in id.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
        }
        Some(ChangeId(id))
    }
}

/// Starts a store's listener (a `LISTEN` connection, a subscriber): called, on the waiter's
/// tokio runtime, when a waiter watches and no listener runs. The listener feeds the hub it is
/// given (a weak handle: it stops once the store is gone) and calls
/// [`ListenerHandle::connected`] after each (re)connection.
pub(crate) type StartListener = dyn Fn(ListenerHandle) + Send + Sync;

/// A store's change notifications: what wakes a request that waits for a running duplicate's
/// answer ([`Policy::wait`](crate::engine::Policy::wait)).
///
/// A waiter [watches](Changes::watch) its record and [announces](Changes::announce) itself
/// (PostgreSQL and Redis mark the record, so that only records someone waits on notify);
/// whatever completes or releases the record [notifies](Changes::notify_key). A notification
/// only wakes: the woken waiter claims again and believes the store, so a lost one costs time,
/// never correctness; every waiter also looks again at its store's
/// [polling cap](Changes::poll_cap), and a listener that reconnected wakes everyone. The engine
/// notifies its own store's hub after its own completes and releases (waiters in the same
/// process); PostgreSQL (`LISTEN`/`NOTIFY`) and Redis (pub/sub) carry notifications between
/// instances; SQLite and MySQL do not, and their waiters elsewhere poll.
#[derive(Clone)]
pub struct Changes {
    hub: Arc<Hub>,
}

/// How a store names a record in its notifications.
type IdOf = dyn Fn(&RecordKey) -> ChangeId + Send + Sync;

/// What a store does when a request starts waiting on a record (PostgreSQL marks it, so its
/// complete notifies).
type Announce = dyn Fn(&RecordKey) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>
    + Send
    + Sync;

struct Hub {
    keys: Mutex<HashMap<ChangeId, watch::Sender<()>>>,
    /// Watches alive: a notification with none (every request of a store nobody waits on)
    /// costs one atomic load, no hash and no lock.
    watches: std::sync::atomic::AtomicUsize,
    id_of: Box<IdOf>,
    announce: Option<Box<Announce>>,
    poll_cap: Duration,
    listener: Option<Box<StartListener>>,
    /// Whether a listener task runs (set by the task's guard; cleared when it ends, however).
    listening: AtomicBool,
}

impl std::fmt::Debug for Changes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Changes")
            .field("poll_cap", &self.hub.poll_cap)
            .field("listener", &self.hub.listener.is_some())
            .field("listening", &self.hub.listening.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Changes {
    /// A hub fed only in process: waiters in other processes are found by polling every
    /// `poll_cap` at most.
    pub fn in_process(poll_cap: Duration) -> Self {
        Self::build(poll_cap, Box::new(ChangeId::of), None)
    }

    /// A hub fed by a listener the first waiter starts, whose notifications name a record
    /// by `id_of`.
    #[cfg_attr(not(any(feature = "postgres", feature = "redis")), allow(dead_code))]
    pub(crate) fn with_listener(
        poll_cap: Duration,
        id_of: impl Fn(&RecordKey) -> ChangeId + Send + Sync + 'static,
        start: impl Fn(ListenerHandle) + Send + Sync + 'static,
    ) -> Self {
        Self::build(poll_cap, Box::new(id_of), Some(Box::new(start)))
    }

    fn build(poll_cap: Duration, id_of: Box<IdOf>, listener: Option<Box<StartListener>>) -> Self {
        Changes {
            hub: Arc::new(Hub {
                keys: Mutex::default(),
                watches: std::sync::atomic::AtomicUsize::new(0),
                id_of,
                announce: None,
                poll_cap,
                listener,
                listening: AtomicBool::new(false),
            }),
        }
    }

    /// What the store does when a request starts waiting on a record; set while the hub is
    /// being built.
    #[cfg_attr(not(any(feature = "postgres", feature = "redis")), allow(dead_code))]
    pub(crate) fn with_announce(
        mut self,
        announce: impl Fn(&RecordKey) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>
        + Send
        + Sync
        + 'static,
    ) -> Self {
        if let Some(hub) = Arc::get_mut(&mut self.hub) {
            hub.announce = Some(Box::new(announce));
        }
        self
    }

    /// Tells the store that a request now waits on `key`'s record (after it watches it, and
    /// before it looks at the store again).
    pub async fn announce(&self, key: &RecordKey) {
        if let Some(announce) = &self.hub.announce {
            announce(key).await;
        }
    }

    /// The longest a waiter goes without looking at the store again.
    pub fn poll_cap(&self) -> Duration {
        self.hub.poll_cap
    }

    /// A waiter's first pause before it looks again unwoken: the cap where a listener
    /// notifies every change (polling is only the safety net there), else 20 ms, doubling up
    /// to the cap (polling is how another process's answer is found).
    pub fn first_poll(&self) -> Duration {
        if self.hub.listener.is_some() {
            self.hub.poll_cap
        } else {
            Duration::from_millis(20).min(self.hub.poll_cap)
        }
    }

    /// The id of `key`'s record in this hub's notifications.
    pub fn id(&self, key: &RecordKey) -> ChangeId {
        (self.hub.id_of)(key)
    }

    /// Wakes the waiters on `key`'s record.
    pub fn notify_key(&self, key: &RecordKey) {
        if self.hub.watches.load(Ordering::Acquire) == 0 {
            return;
        }
        self.notify(self.id(key));
    }

    /// Wakes the waiters on `id`.
    pub fn notify(&self, id: ChangeId) {
        if let Some(sender) = lock(&self.hub.keys).get(&id) {
            sender.send_replace(());
        }
    }

    /// Wakes every waiter (a listener reconnected: what it missed meanwhile is unknown).
    pub fn wake_all(&self) {
        for sender in lock(&self.hub.keys).values() {
            sender.send_replace(());
        }
    }

    /// Waiters on `id` in this process.
    pub fn watchers(&self, id: ChangeId) -> usize {
        lock(&self.hub.keys)
            .get(&id)
            .map_or(0, watch::Sender::receiver_count)
    }

    /// Watches `key`'s record, or `None` when `max` watch it already. Starts the store's
    /// listener if it has one and none runs.
    pub fn watch(&self, key: &RecordKey, max: usize) -> Option<Watch> {
        self.watch_id(self.id(key), max)
    }

    fn watch_id(&self, id: ChangeId, max: usize) -> Option<Watch> {
        let rx = {
            let mut keys = lock(&self.hub.keys);
            match keys.get(&id) {
                Some(sender) if sender.receiver_count() >= max => return None,
                Some(sender) => sender.subscribe(),
                None if max == 0 => return None,
                None => {
                    let (tx, rx) = watch::channel(());
                    keys.insert(id, tx);
                    rx
                }
            }
        };
        // Counted before the waiter's next look at the store: a notification skipped for a zero
        // count came before that look, which finds what it would have announced.
        self.hub.watches.fetch_add(1, Ordering::AcqRel);
        self.ensure_listener();
        Some(Watch {
            hub: Arc::clone(&self.hub),
            id,
            rx,
        })
    }

    fn ensure_listener(&self) {
        let Some(start) = &self.hub.listener else {
            return;
        };
        if tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        if self
            .hub
            .listening
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            start(ListenerHandle {
                hub: Arc::downgrade(&self.hub),
                idle_since: None,
            });
        }
    }
}

/// What a store's listener task holds: a weak handle on its hub. Dropping it (the task ended,
/// or its runtime shut down) lets the next waiter start a listener again.
pub(crate) struct ListenerHandle {
    hub: Weak<Hub>,
    /// Since when nobody has waited (`None`: someone waits).
    idle_since: Option<tokio::time::Instant>,
}

/// How long a listener nobody needs stays connected.
const IDLE_FOR: Duration = Duration::from_secs(60);

impl ListenerHandle {
    /// The hub, while its store lives.
    fn hub(&self) -> Option<Changes> {
        self.hub.upgrade().map(|hub| Changes { hub })
    }

    /// Whether the store is gone (the listener should stop).
    #[cfg_attr(not(any(feature = "postgres", feature = "redis")), allow(dead_code))]
    pub(crate) fn store_gone(&self) -> bool {
        self.hub.strong_count() == 0
    }

    /// Whether anyone waits (a listener may disconnect while nobody does).
    #[cfg_attr(not(any(feature = "postgres", feature = "redis")), allow(dead_code))]
    pub(crate) fn anyone_waits(&self) -> bool {
        self.hub
            .upgrade()
            .is_some_and(|hub| !lock(&hub.keys).is_empty())
    }

    /// Whether the listener should go on, asked after each message and each quiet period: its
    /// store lives and someone waited within the last minute.
    #[cfg_attr(not(any(feature = "postgres", feature = "redis")), allow(dead_code))]
    pub(crate) fn still_needed(&mut self) -> bool {
        if self.store_gone() {
            return false;
        }
        if self.anyone_waits() {
            self.idle_since = None;
            return true;
        }
        self.idle_since
            .get_or_insert_with(tokio::time::Instant::now)
            .elapsed()
            < IDLE_FOR
    }

    /// The listener is (re)connected: every waiter looks again.
    #[cfg_attr(not(any(feature = "postgres", feature = "redis")), allow(dead_code))]
    pub(crate) fn connected(&self) {
        if let Some(changes) = self.hub() {
            changes.wake_all();
        }
    }

    /// A notification arrived with `payload` (a [`ChangeId`] in hex; anything else is ignored).
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn received(&self, payload: &str) {
        if let Some(id) = ChangeId::from_hex(payload) {
            self.received_id(id);
        }
    }

    /// A notification for `id` arrived.
    #[cfg_attr(not(any(feature = "postgres", feature = "redis")), allow(dead_code))]
    pub(crate) fn received_id(&self, id: ChangeId) {
        if let Some(changes) = self.hub() {
            changes.notify(id);
        }
    }
}

impl Drop for ListenerHandle {
    fn drop(&mut self) {
        if let Some(hub) = self.hub.upgrade() {
            hub.listening.store(false, Ordering::Release);
        }
    }
}

/// One waiter's watch on a record: [`Watch::mark`] before looking at the store, then
/// [`Watch::changed`] resolves on any notification since the mark.
pub struct Watch {
    hub: Arc<Hub>,
    id: ChangeId,
    rx: watch::Receiver<()>,
}

impl std::fmt::Debug for Watch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watch").field("id", &self.id).finish()
    }
}

impl Watch {
    /// Marks every notification so far as seen.
    pub fn mark(&mut self) {
        self.rx.mark_unchanged();
    }

    /// Resolves on a notification after the last [`Watch::mark`].
    pub async fn changed(&mut self) {
        // The sender lives in the hub for as long as this receiver does.
        if self.rx.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.hub.watches.fetch_sub(1, Ordering::AcqRel);
        let mut keys = lock(&self.hub.keys);
        // This receiver still counts: the last one out (count 1) removes the entry.
        if keys
            .get(&self.id)
            .is_some_and(|sender| sender.receiver_count() <= 1)
        {
            keys.remove(&self.id);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::IdempotencyKey;
    use crate::scope::Scope;

    fn key(scope: &str, key: &str) -> RecordKey {
        RecordKey::new(
            Scope::new(scope).unwrap(),
            IdempotencyKey::parse(key.as_bytes()).unwrap(),
        )
    }

    #[test]
    fn ids_differ_where_scope_and_key_split_differently() {
        assert_ne!(ChangeId::of(&key("ab", "c")), ChangeId::of(&key("a", "bc")));
        assert_eq!(ChangeId::of(&key("a", "b")), ChangeId::of(&key("a", "b")));
        for bad in ["", "zz", &"0".repeat(31), &"g".repeat(32), &"é".repeat(16)] {
            assert_eq!(ChangeId::from_hex(bad), None, "{bad}");
        }
    }

    #[tokio::test]
    async fn a_notification_after_the_mark_wakes_and_one_before_does_not() {
        let changes = Changes::in_process(Duration::from_secs(1));
        let id = ChangeId::of(&key("a", "k"));
        let mut watch = changes.watch(&key("a", "k"), 2).expect("a place");
        changes.notify(id);
        watch.mark();
        let early = tokio::time::timeout(Duration::from_millis(20), watch.changed()).await;
        assert!(
            early.is_err(),
            "a notification before the mark woke the waiter"
        );
        // Sent between the mark and the wait (while the waiter looked at its store): not lost.
        changes.notify(id);
        tokio::time::timeout(Duration::from_secs(1), watch.changed())
            .await
            .expect("woken");
        // Another key's notification does not wake it; wake_all does.
        watch.mark();
        changes.notify(ChangeId::of(&key("a", "other")));
        let other = tokio::time::timeout(Duration::from_millis(20), watch.changed()).await;
        assert!(other.is_err());
        changes.wake_all();
        tokio::time::timeout(Duration::from_secs(1), watch.changed())
            .await
            .expect("woken by wake_all");
    }

    #[test]
    fn watchers_per_id_are_bounded_and_their_places_given_back() {
        let changes = Changes::in_process(Duration::from_secs(1));
        let id = ChangeId::of(&key("a", "k"));
        let first = changes.watch_id(id, 2).expect("first");
        let second = changes.watch_id(id, 2).expect("second");
        assert!(
            changes.watch_id(id, 2).is_none(),
            "a third past the bound of 2"
        );
        assert_eq!(changes.watchers(id), 2);
        drop(first);
        assert_eq!(changes.watchers(id), 1);
        let third = changes.watch_id(id, 2).expect("a place given back");
        drop((second, third));
        assert_eq!(changes.watchers(id), 0);
        assert!(
            lock(&changes.hub.keys).is_empty(),
            "the entry was left behind"
        );
        assert!(changes.watch_id(id, 0).is_none());
    }
}
