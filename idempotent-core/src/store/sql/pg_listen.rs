//! The PostgreSQL store's change notifications: its complete and release statements (and the
//! transactional complete-and-commit batch) send `pg_notify(channel, id)` themselves, delivered
//! when they commit; one `LISTEN` connection per store, started by the first waiter and kept
//! while anyone waits, feeds the store's [`Changes`] hub.
//!
//! The listener's connection is its own (a one-connection pool with the store pool's
//! options), so it never takes a connection from the pool the handlers use. When that
//! connection is lost (the server restarted, `pg_terminate_backend`), the listener connects
//! again and wakes every waiter: notifications sent meanwhile are lost, so everyone looks
//! again.

use crate::store::changes::ListenerHandle;
use crate::store::record::RecordKey;
use crate::store::{ChangeId, Changes};
use sha2::{Digest, Sha256};
use sqlx::postgres::{PgListener, PgPool, PgPoolOptions};
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

/// Whether the table has the `waited` column (migration 4) that gates the notifications, found
/// once per store (and again after [`PostgresStore::migrate`](crate::PostgresStore::migrate)).
/// Without it, completes and releases notify nobody and waiters mark nothing: other instances'
/// waiters find answers by polling, and a warning says to run the migrations.
const UNKNOWN: u8 = 0;
const CHECKING: u8 = 1;
const PRESENT: u8 = 2;
const ABSENT: u8 = 3;

#[derive(Debug)]
pub(crate) struct Marks {
    /// [`UNKNOWN`], [`CHECKING`], [`PRESENT`] or [`ABSENT`].
    state: AtomicU8,
    /// [`PostgresStoreBuilder::notify_changes`](crate::store::PostgresStoreBuilder::notify_changes).
    on: bool,
    schema: String,
    name: String,
}

impl Marks {
    pub(crate) fn new(on: bool, schema: &str, name: &str) -> Self {
        Marks {
            state: AtomicU8::new(UNKNOWN),
            on,
            schema: schema.to_owned(),
            name: name.to_owned(),
        }
    }

    /// Whether completes and releases notify (the column is there, notifications are on), as
    /// known now: never waits. While unknown it answers `false` (quiet) and finds out in the
    /// background, on a connection of its own from `pool`: a complete holding a connection
    /// never waits for a second one (with every pooled connection held by a completing
    /// transaction, that would wait out the pool's acquire timeout).
    pub(crate) fn known_present(self: &Arc<Self>, pool: &PgPool) -> bool {
        if !self.on {
            return false;
        }
        match self.state.load(Ordering::Acquire) {
            PRESENT => true,
            UNKNOWN if tokio::runtime::Handle::try_current().is_ok() => {
                if self
                    .state
                    .compare_exchange(UNKNOWN, CHECKING, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    let (marks, pool) = (Arc::clone(self), pool.clone());
                    tokio::spawn(async move {
                        marks.check(&pool).await;
                    });
                }
                false
            }
            _ => false,
        }
    }

    /// [`Marks::known_present`], waiting for the answer when it is unknown (for a waiter, which
    /// holds no connection).
    pub(crate) async fn present(&self, pool: &PgPool) -> bool {
        if !self.on {
            return false;
        }
        match self.state.load(Ordering::Acquire) {
            PRESENT => true,
            ABSENT => false,
            _ => self.check(pool).await,
        }
    }

    async fn check(&self, pool: &PgPool) -> bool {
        let found: Result<bool, sqlx::Error> = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM information_schema.columns \
             WHERE table_schema = $1 AND table_name = $2 AND column_name = 'waited')",
        )
        .bind(&self.schema)
        .bind(&self.name)
        .fetch_one(pool)
        .await;
        match found {
            Ok(true) => {
                self.state.store(PRESENT, Ordering::Release);
                true
            }
            Ok(false) => {
                if self.state.swap(ABSENT, Ordering::AcqRel) != ABSENT {
                    tracing::warn!(
                        table = %format!("{}.{}", self.schema, self.name),
                        "idempotency: the table has no `waited` column (run PostgresStore::migrate): requests waiting for another instance's answer find it by polling only"
                    );
                }
                false
            }
            // Unknown for now: quiet meanwhile, asked again next time.
            Err(_) => {
                self.state.store(UNKNOWN, Ordering::Release);
                false
            }
        }
    }

    /// The migrations just ran: the column is there.
    pub(crate) fn migrated(&self) {
        self.state.store(PRESENT, Ordering::Release);
    }
}

/// The longest the listener waits for a message before it checks whether its store is gone
/// and whether anyone still waits.
const CHECK_EVERY: Duration = Duration::from_secs(5);
/// The pause before connecting again after a failure.
const RECONNECT_AFTER: Duration = Duration::from_millis(200);

/// The notification channel of the table `table` (schema-qualified): `idempotent_` and 20 hex
/// digits of its SHA-256, short of PostgreSQL's 63-byte identifier limit for any table name.
pub(crate) fn channel(table: &str) -> String {
    let digest = Sha256::digest(table.as_bytes());
    let hex: String = digest[..10].iter().map(|b| format!("{b:02x}")).collect();
    format!("idempotent_{hex}")
}

/// SQL computing a record's [`ChangeId`](crate::store::ChangeId) in hex from the scope and
/// key expressions `scope` and `key` (the same bytes [`ChangeId::of`](crate::store::ChangeId::of)
/// hashes: the scope's UTF-8 length in decimal, `:`, the scope, the key).
pub(crate) fn change_id_sql(scope: &str, key: &str) -> String {
    format!(
        "left(encode(sha256(convert_to(octet_length(convert_to({scope}, 'UTF8'))::text || ':' || {scope} || {key}, 'UTF8')), 'hex'), 32)"
    )
}

/// The hub of a store on `pool` notified on `channel`; a waiter marks its record with
/// `mark_waited` (the statement), so that its complete or release notifies.
pub(crate) fn changes(
    pool: &PgPool,
    channel: String,
    poll_cap: Duration,
    marks: Arc<Marks>,
    mark_waited: Arc<str>,
) -> Changes {
    let options = (*pool.connect_options()).clone();
    let pool = pool.clone();
    Changes::with_listener(poll_cap, ChangeId::of, move |handle| {
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .min_connections(0)
            .test_before_acquire(false)
            .connect_lazy_with(options.clone());
        tokio::spawn(listen(pool, channel.clone(), handle));
    })
    .with_announce(move |key: &RecordKey| {
        let (pool, marks, sql) = (pool.clone(), Arc::clone(&marks), Arc::clone(&mark_waited));
        let (scope, key) = (key.scope.as_str().to_owned(), key.key.as_str().to_owned());
        Box::pin(async move {
            if !marks.present(&pool).await {
                return;
            }
            let marked = sqlx::query(sqlx::AssertSqlSafe(&*sql))
                .bind(scope)
                .bind(key)
                .execute(&pool)
                .await;
            if let Err(error) = marked {
                // Its answer then reaches it by polling.
                tracing::debug!(error = %error, "idempotency: marking a record waited on failed");
            }
        })
    })
}

/// Runs a store's listener until its store is gone or nobody has waited for a minute (`ListenerHandle::still_needed`).
async fn listen(pool: PgPool, channel: String, mut handle: ListenerHandle) {
    'connect: loop {
        if handle.store_gone() {
            return;
        }
        let mut listener = match connect(&pool, &channel).await {
            Ok(listener) => listener,
            Err(error) => {
                tracing::warn!(error = %error, "idempotency: the PostgreSQL change listener could not connect; waiters poll meanwhile");
                if !handle.anyone_waits() {
                    return;
                }
                tokio::time::sleep(RECONNECT_AFTER).await;
                continue;
            }
        };
        // Whatever was sent before LISTEN took effect is unknown: everyone looks again.
        handle.connected();
        loop {
            match tokio::time::timeout(CHECK_EVERY, listener.try_recv()).await {
                Ok(Ok(Some(notification))) => handle.received(notification.payload()),
                // The connection was lost and made again (eager reconnect): look again.
                Ok(Ok(None)) => handle.connected(),
                Ok(Err(error)) => {
                    tracing::warn!(error = %error, "idempotency: the PostgreSQL change listener lost its connection; connecting again");
                    drop(listener);
                    tokio::time::sleep(RECONNECT_AFTER).await;
                    continue 'connect;
                }
                Err(_) => {}
            }
            if !handle.still_needed() {
                return;
            }
        }
    }
}

async fn connect(pool: &PgPool, channel: &str) -> Result<PgListener, sqlx::Error> {
    let mut listener = PgListener::connect_with(pool).await?;
    listener.listen(channel).await?;
    Ok(listener)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn channels_are_short_identifiers_per_table() {
        let a = channel("public.idempotency_records");
        assert!(a.len() <= 63 && a.starts_with("idempotent_"));
        assert!(
            a.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        );
        assert_ne!(a, channel("other.idempotency_records"));
        assert_eq!(channel(&"x".repeat(200)).len(), 31);
    }
}
