//! The Redis store's change notifications: a request that waits on a record marks it (field `w`,
//! script `MARK`); the complete and release scripts then `PUBLISH` the record's Redis key on
//! [`CHANNEL`] as part of the script (so a notification goes out exactly when a record someone
//! waits on changed, and no message at all for the others), and one subscriber connection per
//! store, started by the first waiter and kept while anyone waits, feeds the store's
//! [`Changes`] hub.
//!
//! On a Redis Cluster a `PUBLISH` reaches every node (the cluster bus carries it), so one
//! subscriber connection, to any node, hears every record's notifications; when that node
//! fails, the subscriber connects to the next node given. Sharded pub/sub (`SPUBLISH`, Redis
//! 7) would keep each message on its shard, but a subscriber would then need a connection per
//! shard and a subscription per waited-on scope: not used yet.
//!
//! When the subscriber's connection is lost (`CLIENT KILL`, a failover), it connects again and
//! wakes every waiter: messages published meanwhile are lost, so everyone looks again.

use crate::store::changes::ListenerHandle;
use crate::store::{ChangeId, Changes};
use futures_util::StreamExt;
use std::time::Duration;

/// The channel every store's scripts publish on (the payload, the record's Redis key, tells
/// stores with other prefixes apart).
pub(super) const CHANNEL: &str = "idempotent:changes";

/// The longest the subscriber waits for a message before it checks whether its store is gone
/// and whether anyone still waits.
const CHECK_EVERY: Duration = Duration::from_secs(5);
/// The pause before connecting again after a failure.
const RECONNECT_AFTER: Duration = Duration::from_millis(200);

/// The hub of a store with `prefix` whose servers are `urls` (one, or a cluster's nodes).
pub(super) fn changes(
    prefix: std::sync::Arc<str>,
    urls: Vec<String>,
    poll_cap: Duration,
    conn: super::connection::Conn,
) -> Changes {
    let ids = std::sync::Arc::clone(&prefix);
    Changes::with_listener(
        poll_cap,
        move |key| ChangeId::of_bytes(&super::keys_of(&ids, key).record),
        move |handle| {
            tokio::spawn(subscribe(urls.clone(), handle));
        },
    )
    .with_announce(move |key| {
        // Marks the record, so its complete or release publishes.
        let record = super::keys_of(&prefix, key).record;
        let conn = conn.share();
        Box::pin(async move {
            let mut mark = super::scripts::scripts().mark.prepare_invoke();
            mark.key(record);
            let marked: redis::RedisResult<redis::Value> = match &conn {
                super::connection::Conn::Single(c) => mark.invoke_async(&mut c.conn().0).await,
                super::connection::Conn::Cluster(c) => mark.invoke_async(&mut c.conn().0).await,
            };
            if let Err(error) = marked {
                // Its answer then reaches it by polling.
                tracing::debug!(error = %error, "idempotency: marking a record waited on failed");
            }
        })
    })
}

/// Runs a store's subscriber until its store is gone or nobody has waited for a minute (`ListenerHandle::still_needed`).
async fn subscribe(urls: Vec<String>, mut handle: ListenerHandle) {
    let mut next = 0;
    loop {
        if handle.store_gone() || urls.is_empty() {
            return;
        }
        let url = &urls[next % urls.len()];
        next += 1;
        let pubsub = match connect(url).await {
            Ok(pubsub) => pubsub,
            Err(error) => {
                tracing::warn!(error = %error, "idempotency: the Redis change subscriber could not connect; waiters poll meanwhile");
                if !handle.anyone_waits() {
                    return;
                }
                tokio::time::sleep(RECONNECT_AFTER).await;
                continue;
            }
        };
        // Whatever was published before SUBSCRIBE took effect is unknown: everyone looks again.
        handle.connected();
        let mut messages = pubsub.into_on_message();
        loop {
            match tokio::time::timeout(CHECK_EVERY, messages.next()).await {
                Ok(Some(message)) => {
                    handle.received_id(ChangeId::of_bytes(message.get_payload_bytes()));
                }
                // The connection was lost: connect again, then everyone looks again.
                Ok(None) => {
                    tracing::warn!(
                        "idempotency: the Redis change subscriber lost its connection; connecting again"
                    );
                    break;
                }
                Err(_) => {}
            }
            if !handle.still_needed() {
                return;
            }
        }
        tokio::time::sleep(RECONNECT_AFTER).await;
    }
}

async fn connect(url: &str) -> redis::RedisResult<redis::aio::PubSub> {
    let client = redis::Client::open(url)?;
    let mut pubsub = client.get_async_pubsub().await?;
    pubsub.subscribe(CHANNEL).await?;
    Ok(pubsub)
}
