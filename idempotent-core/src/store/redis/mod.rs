//! The Redis store: one record is one hash under one hash-tagged key, every operation one Lua
//! script on the node that owns that key's slot, times from the server's `TIME`, expiry by
//! `PEXPIREAT`. Standalone servers and Redis Cluster alike (the `redis` crate's connection
//! manager, or its cluster client).

use crate::store::fence::LeaseToken;
use crate::store::record::{Record, RecordKey, StoredOutcome};
use crate::store::row::{
    Decision, ExistingRow, RecordColumns, build_record, claimed, decide, millis, outcome_columns,
};
use crate::store::{ClaimOutcome, ClaimRequest, Deleted, Store, StoreError};
use connection::{Conn, Connector, Rebuilt, failed};
use redis::Value;
use redis::aio::ConnectionManager;
use redis::cluster_async::ClusterConnection;
use scripts::scripts;
use std::sync::atomic::{AtomicU64, Ordering};

mod connection;
mod listen;
mod scripts;
use std::time::{Duration, SystemTime};

/// The longest lease or ttl the store writes: 1,000 years in milliseconds (longer ones are cut
/// to it, so an absurd setting can never overflow the server's expiry arithmetic).
const MAX_MILLIS: i64 = 1_000 * 365 * 24 * 3600 * 1000;

/// How often a claim runs again when the record changed between its claim script and its
/// take-over script (each time, another attempt made progress).
const MAX_CLAIM_ATTEMPTS: usize = 16;

/// Why a [`RedisStore`] could not be set up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RedisSetupError {
    /// The key prefix is not usable: it must be at most 64 bytes of visible ASCII without `{`
    /// or `}` (the braces delimit each record's hash tag).
    #[error(
        "`{0}` is not a valid key prefix: use at most 64 visible ASCII characters without `{{` or `}}`"
    )]
    InvalidPrefix(String),
    /// The URL is not `redis://…`, `rediss://…`, `redis+cluster://host:port[,host:port…]` or
    /// `rediss+cluster://…`.
    #[error(
        "unsupported Redis URL `{0}`: use redis://host:port[/db] or redis+cluster://host:port[,host:port…]"
    )]
    InvalidUrl(String),
    /// `wait_for_replicas` asked for no replica, or for a timeout that is zero or not below
    /// the response timeout.
    #[error(
        "wait_for_replicas needs at least one replica and a timeout above zero and below the response timeout"
    )]
    InvalidWait,
    /// Connecting failed (or the URL's details were refused by the client).
    #[error("redis error: {0}")]
    Redis(#[from] redis::RedisError),
}

/// How many replicas must acknowledge a claim and a completion, and how long to wait for them.
#[derive(Debug, Clone, Copy)]
struct Wait {
    replicas: u32,
    timeout: Duration,
}

/// Builds a [`RedisStore`]: key prefix, timeouts, replica acknowledgement.
#[derive(Debug, Clone)]
pub struct RedisStoreBuilder {
    prefix: String,
    wait: Option<(u32, Duration)>,
    response_timeout: Duration,
    connection_timeout: Duration,
    bounds: ScopeBounds,
    change_poll: Duration,
}

/// One caller's bounds in Redis (see [`RedisStore`]'s "Per caller bounds").
#[derive(Debug, Clone, Copy)]
struct ScopeBounds {
    records: u64,
    bytes: u64,
}

impl Default for RedisStoreBuilder {
    fn default() -> Self {
        RedisStoreBuilder {
            prefix: "idempotent:".to_owned(),
            wait: None,
            response_timeout: Duration::from_secs(5),
            connection_timeout: Duration::from_secs(5),
            bounds: ScopeBounds {
                records: 100_000,
                bytes: 32 * 1024 * 1024,
            },
            change_poll: Duration::from_secs(1),
        }
    }
}

impl RedisStoreBuilder {
    /// The longest a request waiting for a running duplicate's answer (a route's `wait`) goes
    /// without looking at the store again, when no notification woke it (default 1 s;
    /// a subscriber connection wakes waiters when a record changes, so this only bounds how late a lost notification is found). At least 10 ms.
    #[must_use]
    pub fn change_poll(mut self, every: Duration) -> Self {
        self.change_poll = every.max(Duration::from_millis(10));
        self
    }

    /// The prefix of every record's key (default `idempotent:`), so one server can hold the
    /// records of several services: `<prefix>{<scope>}:<key>` (see [`RedisStore::redis_key`]).
    #[must_use]
    pub fn prefix(mut self, prefix: &str) -> Self {
        prefix.clone_into(&mut self.prefix);
        self
    }

    /// After each claim and each completion, `WAIT replicas timeout` on the record's primary
    /// (the timeout must be below [`RedisStoreBuilder::response_timeout`], and should be well
    /// below it: see the store's docs):
    /// the claim counts only once `replicas` replicas hold it, so a primary that dies before
    /// replicating it cannot lose it in a failover to one of them (see the store's docs). Off
    /// by default.
    #[must_use]
    pub fn wait_for_replicas(mut self, replicas: u32, timeout: Duration) -> Self {
        self.wait = Some((replicas, timeout));
        self
    }

    /// How long one command may wait for its answer before the store reports
    /// [`StoreError::Unavailable`] (default 5 s).
    ///
    /// A command that gets no answer in time also replaces its connection (in the
    /// background): a connection that stays open but silent is not given back.
    ///
    /// A lease renewal does not wait the whole timeout when its lease is short. An execution
    /// renews its lease half a lease before it ends; the renewal gets an eighth of the lease
    /// on its connection, then waits for the new connection and tries once more there, all
    /// within seven sixteenths of the lease. So a lease shorter than the timeout survives a
    /// connection that stops answering, provided a new connection is up and answers within
    /// about a quarter of the lease (500 ms for a 2 s lease); the completion, which may wait
    /// the whole timeout, is retried on the new connection while the renewals keep the lease.
    /// A lease must still outlast the time the store needs to answer again (see
    /// [`RedisStore`] on a failover). Keep the timeout under 10 s: the engine gives up on a
    /// completion that got no answer for 10 s (or a lease, if longer) without replacing the
    /// connection.
    #[must_use]
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }

    /// Upper bound on the records one scope (caller) holds (default 100,000; at least 1), as
    /// the memory store's: a new key of a caller at its bound is refused
    /// ([`StoreError::ScopeCapacity`]; HTTP: 503) while other callers' go on. The unscoped
    /// namespaces have no per-scope bound. See [`RedisStore`]'s "Per caller bounds".
    #[must_use]
    pub fn max_per_scope(mut self, records: u64) -> Self {
        self.bounds.records = records.max(1);
        self
    }

    /// Upper bound on the bytes one scope's records are charged (default 32 MiB), as the
    /// memory store's: each claim reserves what its outcome may store, so a caller's
    /// concurrent requests cannot take Redis's memory for everyone
    /// ([`StoreError::ScopeByteCapacity`]; HTTP: 503). See [`RedisStore`]'s "Per caller
    /// bounds".
    #[must_use]
    pub fn max_bytes_per_scope(mut self, bytes: u64) -> Self {
        self.bounds.bytes = bytes;
        self
    }

    /// How long connecting may take (default 5 s).
    #[must_use]
    pub fn connection_timeout(mut self, timeout: Duration) -> Self {
        self.connection_timeout = timeout;
        self
    }

    fn checked(&self) -> Result<(String, Option<Wait>), RedisSetupError> {
        let p = &self.prefix;
        if p.len() > 64
            || !p
                .bytes()
                .all(|b| b.is_ascii_graphic() && b != b'{' && b != b'}')
        {
            return Err(RedisSetupError::InvalidPrefix(p.clone()));
        }
        let wait = match self.wait {
            None => None,
            Some((0, _)) => return Err(RedisSetupError::InvalidWait),
            Some((_, t)) if t.is_zero() || t >= self.response_timeout => {
                return Err(RedisSetupError::InvalidWait);
            }
            Some((replicas, timeout)) => Some(Wait { replicas, timeout }),
        };
        Ok((p.clone(), wait))
    }

    /// Connects to `url`: `redis://host:port[/db]` (or `rediss://`) for one server,
    /// `redis+cluster://host:port[,host:port…]` (or `rediss+cluster://`) for a Redis Cluster
    /// given one or more of its nodes.
    ///
    /// # Errors
    /// [`RedisSetupError`]: a bad prefix or URL, or a server that cannot be reached.
    pub async fn connect(self, url: &str) -> Result<RedisStore, RedisSetupError> {
        for (scheme, plain) in [
            ("redis+cluster://", "redis://"),
            ("rediss+cluster://", "rediss://"),
        ] {
            if let Some(rest) = url.strip_prefix(scheme) {
                let nodes: Vec<String> = rest
                    .split(',')
                    .filter(|n| !n.is_empty())
                    .map(|n| format!("{plain}{n}"))
                    .collect();
                if nodes.is_empty() {
                    return Err(RedisSetupError::InvalidUrl(without_credentials(url)));
                }
                return self.connect_cluster(&nodes).await;
            }
        }
        if !(url.starts_with("redis://") || url.starts_with("rediss://")) {
            return Err(RedisSetupError::InvalidUrl(without_credentials(url)));
        }
        let (prefix, wait) = self.checked()?;
        let client = redis::Client::open(url)?;
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_response_timeout(Some(self.response_timeout))
            .set_connection_timeout(Some(self.connection_timeout))
            .set_number_of_retries(2);
        let connector = || -> Connector<ConnectionManager> {
            let (client, config) = (client.clone(), config.clone());
            Box::new(move || {
                let (client, config) = (client.clone(), config.clone());
                Box::pin(ConnectionManager::new_with_config(client, config))
            })
        };
        let conn = std::sync::Arc::new(Rebuilt::connect(connector()).await?);
        let durable = match wait {
            Some(_) => Some(Conn::Single(std::sync::Arc::new(
                Rebuilt::connect(connector()).await?,
            ))),
            None => None,
        };
        Ok(RedisStore::new(
            Conn::Single(conn),
            durable,
            prefix,
            wait,
            self.response_timeout,
            self.bounds,
            (vec![url.to_owned()], self.change_poll),
        ))
    }

    /// Connects to a Redis Cluster through any of its `nodes` (`redis://host:port` each).
    ///
    /// # Errors
    /// [`RedisSetupError`]: a bad prefix or URL, or no node that answers.
    pub async fn connect_cluster(
        self,
        nodes: &[impl AsRef<str>],
    ) -> Result<RedisStore, RedisSetupError> {
        let (prefix, wait) = self.checked()?;
        let nodes: Vec<&str> = nodes.iter().map(AsRef::as_ref).collect();
        let urls = nodes.iter().map(|n| (*n).to_owned()).collect();
        let client = redis::cluster::ClusterClient::builder(nodes)
            .response_timeout(self.response_timeout)
            .connection_timeout(self.connection_timeout)
            .build()?;
        let connector = || -> Connector<ClusterConnection> {
            let client = client.clone();
            Box::new(move || {
                let client = client.clone();
                Box::pin(async move { client.get_async_connection().await })
            })
        };
        let conn = Conn::Cluster(std::sync::Arc::new(Rebuilt::connect(connector()).await?));
        let durable = match wait {
            Some(_) => Some(Conn::Cluster(std::sync::Arc::new(
                Rebuilt::connect(connector()).await?,
            ))),
            None => None,
        };
        Ok(RedisStore::new(
            conn,
            durable,
            prefix,
            wait,
            self.response_timeout,
            self.bounds,
            (urls, self.change_poll),
        ))
    }
}

/// The keys a script on `key`'s record takes: the record's, and its scope's usage when
/// the scope is counted.
fn keys_of(prefix: &str, key: &RecordKey) -> Keys {
    fn escape(out: &mut Vec<u8>, s: &str) {
        for b in s.bytes() {
            match b {
                b'%' => out.extend_from_slice(b"%25"),
                b'}' => out.extend_from_slice(b"%7D"),
                b => out.push(b),
            }
        }
    }
    let mut scope = Vec::with_capacity(key.scope.as_str().len());
    escape(&mut scope, key.scope.as_str());
    let mut tag = Vec::with_capacity(prefix.len() + scope.len() + key.key.as_str().len() + 16);
    tag.extend_from_slice(prefix.as_bytes());
    tag.push(b'{');
    tag.extend_from_slice(scope.len().to_string().as_bytes());
    tag.push(b':');
    tag.extend_from_slice(&scope);
    if key.scope.is_shared() {
        tag.push(b':');
        escape(&mut tag, key.key.as_str());
        tag.push(b'}');
        return Keys {
            record: tag,
            usage: None,
        };
    }
    tag.push(b'}');
    let mut record = tag.clone();
    record.push(b':');
    escape(&mut record, key.key.as_str());
    let mut members = tag.clone();
    members.extend_from_slice(b"#z");
    let mut charges = tag;
    charges.extend_from_slice(b"#u");
    Keys {
        record,
        usage: Some((members, charges)),
    }
}

/// Idempotency records in Redis: a standalone server or a Redis Cluster (feature `redis`).
///
/// - **One record, one key**: `<prefix>{<scope>}:<key>`, a hash (see [`RedisStore::redis_key`]).
///   The hash tag is the caller's scope (length-prefixed, `%` and `}` escaped), so a record and
///   its caller's usage never span slots and every operation is one Lua script on the node
///   that owns them: claim, take-over, complete, release, heartbeat, delete, each atomic.
/// - **Time is the server's** (`TIME` inside the script), so instances with skewed clocks
///   agree on leases and expiry, as with the SQL stores' database clock.
/// - **Fenced**: complete, release and extend change the record only while it carries the
///   caller's token and is in progress.
/// - **Expiry by Redis**: each record's key expires (`PEXPIREAT`) when its ttl does, so no
///   sweeper is needed: [`Store::purge_expired`] deletes nothing and the adapters' automatic
///   sweeper does not start for this store ([`Store::expires_by_itself`]).
/// - **Plain mode only**: no transaction spans Redis and the handler's own database, so
///   transactional routes refuse this store. A handler whose effect is a write to a database
///   should keep its records in that database (transactional mode); one whose effect is a call
///   to another API should pass a derived key downstream ([`crate::Idempotent::derive`]).
///
/// # Replication and failover
/// Redis replicates asynchronously. A claim that the primary acknowledged but had not yet sent
/// to a replica is **lost if that primary dies and the replica takes over**: a retry then finds
/// no record and runs the handler a second time. The same holds for a stored response (the
/// retry runs again rather than replaying). [`RedisStoreBuilder::wait_for_replicas`] closes
/// that window for the replicas it counts: after each claim and each completion the store
/// sends `WAIT n timeout` to the record's primary, and a claim that fewer than `n` replicas
/// acknowledged in time is released and answered [`StoreError::Unavailable`] (503) before the
/// handler runs. A completion that fewer replicas acknowledged is reported as
/// [`StoreError::Unavailable`], so the engine retries it within the lease: with a wait, a
/// completion the fence refuses because this same token already completed the record answers
/// `Ok` once the replicas hold it (it writes the completion time again, so its `WAIT` covers
/// the first completion whatever connection it runs on), and after a failover the retry
/// completes the replicated claim on the new primary. If it never gets its acknowledgement
/// the record stays in progress (or done on the primary alone) until its lease ends, as with
/// any completion that could not be stored.
/// A graceful `CLUSTER FAILOVER` waits for the replica to catch up, so it loses nothing
/// either way.
///
/// Each `WAIT` holds up the commands queued behind it on its connection, so claims and
/// completions (with their `WAIT`s) go through a connection of their own, apart from releases
/// and heartbeats. While a primary's replicas lag or are missing, its claims (replays
/// included) queue behind one another's `WAIT`s, each up to the wait's timeout: they answer
/// 503, and one whose answer times out after its script ran holds its key, answering 409,
/// until its lease ends. Other shards are not held up.
///
/// # Per caller bounds
/// As in the memory store, one caller (scope) holds at most
/// [`max_per_scope`](RedisStoreBuilder::max_per_scope) records (default 100,000) and is
/// charged at most [`max_bytes_per_scope`](RedisStoreBuilder::max_bytes_per_scope) (default
/// 32 MiB), so one caller cannot fill `maxmemory` for everyone. A claim is charged an estimate
/// of its record ([`RedisStore::RECORD_OVERHEAD`] and its key three times) and what its
/// outcome may store, the route's `max_response` ([`ClaimRequest::max_stored`]); the claim
/// script itself checks both bounds and refuses a new record that does not fit
/// ([`StoreError::ScopeCapacity`], [`StoreError::ScopeByteCapacity`]; HTTP: 503 with
/// `Retry-After`). The completion settles the reservation to what was stored; a release or a
/// delete gives it back; records Redis expired are swept out of the caller's usage by its next
/// claims. The usage is a sorted set of the caller's records (by expiry) and a hash of their
/// charges, which live as long as its longest record.
///
/// For that, one caller's records and usage share one hash tag, its scope: on a Redis Cluster
/// all of one caller's records are on one slot (callers spread over the slots; the unscoped
/// namespaces, shared by every caller and bounded only by `maxmemory`, spread record by
/// record). A caller's load is one node's.
///
/// **Sizing `maxmemory`.** With the required `noeviction`, a node at `maxmemory` refuses every
/// write: its claims answer 503 and completions in flight fail (those handlers run again after
/// their lease). The bounds keep one caller from getting there; the sum of every caller's does
/// not: give each node `maxmemory` for the callers active within a ttl on it (each at most
/// `max_bytes_per_scope`; a record of a small response costs about
/// [`RedisStore::RECORD_OVERHEAD`] + 3 × its key's length + the response), plus room for the
/// unscoped routes, and alert on `used_memory` nearing `maxmemory`.
///
/// # What else loses records
/// Anything that drops a key lets a retry run the handler again: an eviction policy other
/// than `noeviction` (every record has an expiry, so `volatile-*` policies evict them too),
/// a standalone server restarted without persistence (or losing the last second of an
/// `appendfsync everysec` log; `WAIT` counts replicas, not disks), and a primary without
/// persistence that restarts before its replica took over (the replica then resyncs to
/// empty). Run the store's Redis with `maxmemory-policy noeviction` and persistence, or with
/// replicas and `wait_for_replicas`. Leases and expiry are absolute times taken from the
/// primary's clock and keep running through a failover: a lease shorter than twice the
/// failover time (`cluster-node-timeout` plus the election; its default is 15 s, half the
/// default 30 s lease) can run out while the execution that holds it cannot reach the new
/// primary, and a retry then takes it over.
///
/// ```no_run
/// use idempotent_core::store::RedisStore;
///
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// let standalone = RedisStore::connect("redis://127.0.0.1:6379").await?;
/// let cluster = RedisStore::builder()
///     .prefix("payments:")
///     .wait_for_replicas(1, std::time::Duration::from_millis(500))
///     .connect("redis+cluster://127.0.0.1:7000,127.0.0.1:7001")
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisStore {
    conn: Conn,
    /// With `wait_for_replicas`: the connection claims and completions go through, each
    /// followed by its `WAIT` there (a `WAIT` holds up every later command on its connection,
    /// so it never runs on the one replays and heartbeats use).
    durable: Option<Conn>,
    prefix: std::sync::Arc<str>,
    wait: Option<Wait>,
    short_waits: std::sync::Arc<AtomicU64>,
    /// The response timeout its connections were built with (a renewal gets at most that).
    response_timeout: Duration,
    /// Each counted scope's bounds.
    bounds: ScopeBounds,
    /// Wakes requests waiting on a record: fed by a subscriber connection (`listen`).
    changes: crate::store::Changes,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field(
                "mode",
                &match self.conn {
                    Conn::Single(_) => "standalone",
                    Conn::Cluster(_) => "cluster",
                },
            )
            .field("prefix", &self.prefix)
            .field("wait", &self.wait)
            .field("max_per_scope", &self.bounds.records)
            .field("max_bytes_per_scope", &self.bounds.bytes)
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    fn new(
        conn: Conn,
        durable: Option<Conn>,
        prefix: String,
        wait: Option<Wait>,
        response_timeout: Duration,
        bounds: ScopeBounds,
        (urls, change_poll): (Vec<String>, Duration),
    ) -> Self {
        let prefix: std::sync::Arc<str> = prefix.into();
        RedisStore {
            changes: listen::changes(
                std::sync::Arc::clone(&prefix),
                urls,
                change_poll,
                conn.share(),
            ),
            conn,
            durable,
            prefix,
            wait,
            short_waits: std::sync::Arc::default(),
            response_timeout,
            bounds,
        }
    }

    /// Bytes charged per record on top of its Redis key (counted three times: the record's
    /// key, and its member and field in its scope's usage) and what it stores: the hash's
    /// fields (fingerprint, token, times), Redis's own per-key and per-field structures and
    /// allocator rounding. An estimate, as the memory store's
    /// [`RECORD_OVERHEAD`](crate::MemoryStore::RECORD_OVERHEAD) is.
    pub const RECORD_OVERHEAD: u64 = 320;

    /// What the record under `rkey` is charged, its outcome taking `outcome` bytes.
    fn charge(rkey: &[u8], outcome: u64) -> u64 {
        Self::RECORD_OVERHEAD
            .saturating_add(3 * rkey.len() as u64)
            .saturating_add(outcome)
    }

    /// Connects with the default settings (see [`RedisStoreBuilder::connect`] for the URLs).
    ///
    /// # Errors
    /// [`RedisSetupError`].
    pub async fn connect(url: &str) -> Result<Self, RedisSetupError> {
        RedisStoreBuilder::default().connect(url).await
    }

    /// Settings before connecting.
    pub fn builder() -> RedisStoreBuilder {
        RedisStoreBuilder::default()
    }

    /// The prefix of every record's key.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Whether this store talks to a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        matches!(self.conn, Conn::Cluster(_))
    }

    /// Claims and completions whose `WAIT` came back with fewer replicas than asked (see
    /// [`RedisStoreBuilder::wait_for_replicas`]).
    pub fn short_waits(&self) -> u64 {
        self.short_waits.load(Ordering::Relaxed)
    }

    /// The Redis key that holds `key`'s record. A caller's (a counted scope's):
    /// `<prefix>{<len>:<scope>}:<key>`, whose hash tag is the scope, so all its records and
    /// its usage (`<prefix>{<len>:<scope>}#z`, `…#u`) share one slot and every script that
    /// charges it is atomic. An unscoped namespace's (shared by every caller, with no per-scope
    /// bound): `<prefix>{<len>:<scope>:<key>}`, whose hash tag is the whole (scope, key), so
    /// those records spread over every slot. Scope and key have `%` and `}` percent-escaped
    /// and the escaped scope's byte length in front, so no two (scope, key) pairs share a key
    /// and no record key is a usage key (after the tag, a record has `:`, a usage `#`).
    pub fn redis_key(&self, key: &RecordKey) -> Vec<u8> {
        self.keys(key).record
    }

    /// The keys a script on `key`'s record takes: the record's, and its scope's usage when
    /// the scope is counted.
    fn keys(&self, key: &RecordKey) -> Keys {
        keys_of(&self.prefix, key)
    }

    /// Runs one of the store's scripts on the record's node.
    async fn run(
        &self,
        script: &redis::Script,
        keys: &[&[u8]],
        args: &[&[u8]],
    ) -> Result<Value, StoreError> {
        self.run_on(&self.conn, script, keys, args).await
    }

    /// The connection of the writes a `WAIT` follows (see `durable`).
    fn durable(&self) -> &Conn {
        self.durable.as_ref().unwrap_or(&self.conn)
    }

    async fn run_on(
        &self,
        conn: &Conn,
        script: &redis::Script,
        keys: &[&[u8]],
        args: &[&[u8]],
    ) -> Result<Value, StoreError> {
        let mut inv = script.prepare_invoke();
        for k in keys {
            inv.key(*k);
        }
        for a in args {
            inv.arg(*a);
        }
        let (result, generation) = match conn {
            Conn::Single(c) => {
                let (mut c, generation) = c.conn();
                (inv.invoke_async(&mut c).await, generation)
            }
            Conn::Cluster(c) => {
                let (mut c, generation) = c.conn();
                (inv.invoke_async(&mut c).await, generation)
            }
        };
        result.map_err(|e| failed(conn, generation, e))
    }

    /// Runs a write that `WAIT` follows: without a wait, as any script; with one, the script
    /// (`EVAL`, its whole source) and `WAIT` in one pipeline on the durable connection, so the
    /// `WAIT` runs on the very connection and node that ran the write (a `WAIT` on another
    /// connection, after a reconnection or a failover, would count replicas of nothing of
    /// ours). Also returns how many replicas acknowledged, with a wait.
    async fn run_durable(
        &self,
        src: &str,
        script: &redis::Script,
        keys: &[&[u8]],
        args: &[&[u8]],
    ) -> Result<(Value, Option<u32>), StoreError> {
        let Some(wait) = self.wait else {
            return Ok((self.run_on(&self.conn, script, keys, args).await?, None));
        };
        let timeout_ms = u64::try_from(wait.timeout.as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        let mut pipe = redis::pipe();
        let eval = pipe.cmd("EVAL").arg(src).arg(keys.len());
        for k in keys {
            eval.arg(*k);
        }
        for a in args {
            eval.arg(*a);
        }
        pipe.cmd("WAIT").arg(wait.replicas).arg(timeout_ms);
        let conn = self.durable();
        let (result, generation): (redis::RedisResult<(Value, i64)>, u64) = match conn {
            Conn::Single(c) => {
                let (mut c, generation) = c.conn();
                (pipe.query_async(&mut c).await, generation)
            }
            Conn::Cluster(c) => {
                let (mut c, generation) = c.conn();
                (pipe.query_async(&mut c).await, generation)
            }
        };
        let (value, acked) = result.map_err(|e| failed(conn, generation, e))?;
        Ok((value, Some(u32::try_from(acked).unwrap_or(0))))
    }

    /// Whether the replicas asked for acknowledged a write (`acked` from
    /// [`RedisStore::run_durable`]; always, without a wait).
    fn replicated(&self, acked: Option<u32>, what: &str) -> bool {
        let (Some(wait), Some(acked)) = (self.wait, acked) else {
            return true;
        };
        if acked >= wait.replicas {
            return true;
        }
        self.short_waits.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            acked,
            wanted = wait.replicas,
            "redis store: {what} acknowledged by fewer replicas than asked within {:?}",
            wait.timeout
        );
        false
    }

    /// One claim (and take-over) attempt: the outcome (`None`: the record changed between the
    /// two scripts) with, for a replay, how long the record still lives, and, with a wait, how
    /// many replicas acknowledged the script that decided it.
    async fn claim_once(
        &self,
        keys: &Keys,
        req: &ClaimRequest<'_>,
    ) -> Result<(Option<(ClaimOutcome, Option<Duration>)>, Option<u32>), StoreError> {
        let token = LeaseToken::generate();
        let fingerprint = req.fingerprint.to_stored();
        let lease = millis(req.lease).min(MAX_MILLIS);
        let expiry = lease.saturating_add(millis(req.ttl).min(MAX_MILLIS));
        // A counted scope's claim reserves what its outcome may store, never more than half
        // its bound (a route whose `max_response` is above it would be refused at every
        // claim; its larger responses are charged when stored).
        let reserve = req.max_stored.min(self.bounds.bytes / 2);
        let charge = Self::charge(&keys.record, reserve).to_string();
        let (max_bytes, max_records) = (
            self.bounds.bytes.to_string(),
            self.bounds.records.to_string(),
        );
        let (lease_ms, expiry_ms) = (lease.to_string(), expiry.to_string());
        let token_id = token.as_uuid();
        let mut args: Vec<&[u8]> = vec![
            &fingerprint,
            token_id.as_bytes(),
            lease_ms.as_bytes(),
            expiry_ms.as_bytes(),
        ];
        if keys.usage.is_some() {
            args.extend([
                charge.as_bytes(),
                max_bytes.as_bytes(),
                max_records.as_bytes(),
            ]);
        }
        let (v, acked) = self
            .run_durable(&scripts().claim_src, &scripts().claim, &keys.all(), &args)
            .await?;
        let fields = array(v)?;
        match int(&fields, 0)? {
            1 => return Ok((Some((claimed(token, int(&fields, 1)?, false), None)), acked)),
            2 if int(&fields, 1)? == 0 => {
                return Err(StoreError::ScopeCapacity {
                    max_per_scope: usize::try_from(self.bounds.records).unwrap_or(usize::MAX),
                });
            }
            2 => {
                return Err(StoreError::ScopeByteCapacity {
                    max_bytes_per_scope: self.bounds.bytes,
                });
            }
            _ => {}
        }
        let row = ExistingRow {
            fingerprint: bytes(&fields, 1)?.unwrap_or_default(),
            done: int(&fields, 3)? == 1,
            token: uuid(&fields, 2)?,
            expired: int(&fields, 4)? == 1,
            lease_over: int(&fields, 5)? == 1,
            retry_ms: int(&fields, 6)?,
            status: opt_num(&fields, 7)?,
            headers: bytes(&fields, 8)?,
            body: bytes(&fields, 9)?,
            oversized: opt_num(&fields, 10)?,
        };
        match decide(row, req.fingerprint)? {
            Decision::Report(outcome, lives) => Ok((Some((outcome, lives)), acked)),
            Decision::TakeOver(old) => {
                let token = LeaseToken::generate();
                let (v, acked) = self
                    .run_durable(
                        &scripts().take_over_src,
                        &scripts().take_over,
                        &keys.all(),
                        &[
                            old.as_uuid().as_bytes(),
                            &fingerprint,
                            token.as_uuid().as_bytes(),
                            lease_ms.as_bytes(),
                            expiry_ms.as_bytes(),
                            charge.as_bytes(),
                        ],
                    )
                    .await?;
                match v {
                    Value::Nil => Ok((None, acked)),
                    v => Ok((Some((claimed(token, num(&v)?, true), None)), acked)),
                }
            }
        }
    }

    async fn fenced(
        &self,
        conn: &Conn,
        script: &redis::Script,
        key: &RecordKey,
        args: &[&[u8]],
    ) -> Result<i64, StoreError> {
        let keys = self.keys(key);
        let v = self.run_on(conn, script, &keys.all(), args).await?;
        let n = num(&v)?;
        if n == 0 {
            return Err(StoreError::StaleLease);
        }
        Ok(n)
    }
}

/// Maps a client error: a script's own error or a type mismatch is a corrupt record (a key of
/// ours that holds something else); everything else (I/O, timeouts, `MOVED` storms, a cluster
/// down, `LOADING`, `READONLY`) is unavailable.
fn redis_error(e: redis::RedisError) -> StoreError {
    match e.kind() {
        redis::ErrorKind::UnexpectedReturnType | redis::ErrorKind::Parse => {
            StoreError::Corrupt(e.to_string())
        }
        // A pipeline reports a script's error without its code: look for it in the text.
        _ if e.code() == Some("WRONGTYPE") || e.to_string().contains("WRONGTYPE") => {
            StoreError::Corrupt(e.to_string())
        }
        _ => StoreError::unavailable(e),
    }
}

fn corrupt(what: &str) -> StoreError {
    StoreError::Corrupt(format!("redis record: {what}"))
}

fn array(v: Value) -> Result<Vec<Value>, StoreError> {
    match v {
        Value::Array(a) => Ok(a),
        _ => Err(corrupt("unexpected script reply")),
    }
}

fn num(v: &Value) -> Result<i64, StoreError> {
    match v {
        Value::Int(n) => Ok(*n),
        Value::BulkString(b) => std::str::from_utf8(b)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| corrupt("a number field is not a number")),
        _ => Err(corrupt("a number field is missing")),
    }
}

fn int(f: &[Value], i: usize) -> Result<i64, StoreError> {
    num(f.get(i).ok_or_else(|| corrupt("short script reply"))?)
}

fn opt_num<T: TryFrom<i64>>(f: &[Value], i: usize) -> Result<Option<T>, StoreError> {
    match f.get(i) {
        None | Some(Value::Nil) => Ok(None),
        Some(v) => T::try_from(num(v)?)
            .map(Some)
            .map_err(|_| corrupt("a number field is out of range")),
    }
}

fn bytes(f: &[Value], i: usize) -> Result<Option<Vec<u8>>, StoreError> {
    match f.get(i) {
        None | Some(Value::Nil) => Ok(None),
        Some(Value::BulkString(b)) => Ok(Some(b.clone())),
        Some(_) => Err(corrupt("a byte field is not a string")),
    }
}

fn uuid(f: &[Value], i: usize) -> Result<uuid::Uuid, StoreError> {
    bytes(f, i)?
        .and_then(|b| uuid::Uuid::from_slice(&b).ok())
        .ok_or_else(|| corrupt("the token is not 16 bytes"))
}

/// A record from `get`'s or `delete`'s fields (see [`FIELDS`]), starting at `at`.
fn record_from(key: &RecordKey, f: &[Value], at: usize) -> Result<Record, StoreError> {
    let f = f.get(at..).ok_or_else(|| corrupt("short script reply"))?;
    build_record(
        key,
        RecordColumns {
            fingerprint: bytes(f, 0)?.unwrap_or_default(),
            token: uuid(f, 1)?,
            done: bytes(f, 2)?.as_deref() == Some(b"1"),
            locked_until: opt_num(f, 3)?,
            status: opt_num(f, 4)?,
            headers: bytes(f, 5)?,
            body: bytes(f, 6)?,
            oversized: opt_num(f, 7)?,
            created_at: opt_num(f, 8)?.unwrap_or_default(),
            completed_at: opt_num(f, 9)?,
            expires_at: opt_num(f, 10)?.unwrap_or_default(),
        },
    )
}

#[async_trait::async_trait]
impl Store for RedisStore {
    async fn claim(&self, req: ClaimRequest<'_>) -> Result<ClaimOutcome, StoreError> {
        self.claim_with_expiry(req)
            .await
            .map(|(outcome, _)| outcome)
    }

    async fn claim_with_expiry(
        &self,
        req: ClaimRequest<'_>,
    ) -> Result<(ClaimOutcome, Option<Duration>), StoreError> {
        let keys = self.keys(req.key);
        for _ in 0..MAX_CLAIM_ATTEMPTS {
            let (Some((outcome, lives)), acked) = self.claim_once(&keys, &req).await? else {
                continue;
            };
            if let ClaimOutcome::Claimed(lease) = &outcome
                && !self.replicated(acked, "a claim")
            {
                // Not on enough replicas: a failover could lose it, and a retry would run the
                // handler again. Give the key back (best effort: a release lost with the
                // primary leaves nothing either) and let the client retry.
                let _ = Store::release(self, req.key, lease.token).await;
                return Err(StoreError::unavailable(NotReplicated));
            }
            return Ok((outcome, lives));
        }
        Err(StoreError::unavailable(Contention))
    }

    async fn complete(
        &self,
        key: &RecordKey,
        token: LeaseToken,
        outcome: &StoredOutcome,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let c = outcome_columns(outcome);
        let status = c.status.to_string();
        let oversized = c.oversized.map(|n| n.to_string()).unwrap_or_default();
        let ttl = millis(ttl).min(MAX_MILLIS).to_string();
        let keys = self.keys(key);
        let (headers, body) = (
            c.headers.as_deref().unwrap_or_default(),
            c.body.as_deref().unwrap_or_default(),
        );
        // What the done record is charged: it settles the claim's reservation.
        let stored = (status.len() + headers.len() + body.len() + oversized.len()) as u64;
        let charge = Self::charge(&keys.record, stored).to_string();
        let (v, acked) = self
            .run_durable(
                &scripts().complete_src,
                &scripts().complete,
                &keys.all(),
                &[
                    token.as_uuid().as_bytes(),
                    status.as_bytes(),
                    headers,
                    body,
                    oversized.as_bytes(),
                    ttl.as_bytes(),
                    charge.as_bytes(),
                ],
            )
            .await?;
        let mut acked = acked;
        if num(&v)? == 0 {
            // Refused. With a wait, a retry of this token's own completion (its answer or its
            // `WAIT` failed) is done once the replicas hold it.
            if self.wait.is_none() {
                return Err(StoreError::StaleLease);
            }
            let (done, confirmed) = self
                .run_durable(
                    &scripts().confirm_src,
                    &scripts().confirm,
                    &[&keys.record],
                    &[token.as_uuid().as_bytes()],
                )
                .await?;
            if num(&done)? == 0 {
                return Err(StoreError::StaleLease);
            }
            acked = confirmed;
        }
        // Stored on the primary, but a failover now could lose it, and a retry would then run
        // the handler again once the lease ran out. Reported as unavailable, so the engine
        // retries the completion within the lease: a retry on this primary finds it done by
        // this token (no write, `WAIT` again), one on a replica that took over finds the
        // replicated claim and completes it there.
        if !self.replicated(acked, "a completion") {
            return Err(StoreError::unavailable(NotReplicated));
        }
        Ok(())
    }

    async fn release(&self, key: &RecordKey, token: LeaseToken) -> Result<(), StoreError> {
        self.fenced(
            &self.conn,
            &scripts().release,
            key,
            &[token.as_uuid().as_bytes()],
        )
        .await
        .map(drop)
    }

    async fn extend(
        &self,
        key: &RecordKey,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<SystemTime, StoreError> {
        // A renewal is sent half a lease before the lease ends: it gets an eighth of the lease
        // on the current connection, then, if that did not answer, waits for a new one and
        // tries once more there, within seven sixteenths of the lease in all (see
        // `RedisStoreBuilder::response_timeout`).
        let started = tokio::time::Instant::now();
        let first_bound = lease / 8;
        let deadline = started + lease / 16 * 7;
        let lease = millis(lease).min(MAX_MILLIS).to_string();
        let token = token.as_uuid();
        let args: [&[u8]; 2] = [token.as_bytes(), lease.as_bytes()];
        let extend = || self.fenced(&self.conn, &scripts().extend, key, &args);
        if first_bound >= self.response_timeout {
            return Ok(crate::store::row::from_millis(extend().await?));
        }
        let generation = self.conn.generation();
        match tokio::time::timeout(first_bound, extend()).await {
            Ok(Ok(until)) => return Ok(crate::store::row::from_millis(until)),
            // No answer in time: a new connection, within the same deadline.
            Err(_) => self.conn.rebuild(generation),
            // The connection failed at once (a reset in a failover, say) and is being
            // replaced: the same. The server's own refusals (`BUSY`, `OOM`) keep it.
            Ok(Err(StoreError::Unavailable(_))) if self.conn.replacing(generation) => {}
            Ok(Err(e)) => return Err(e),
        }
        if self.conn.replaced(generation, deadline).await {
            let generation = self.conn.generation();
            match tokio::time::timeout_at(deadline, extend()).await {
                Ok(until) => return Ok(crate::store::row::from_millis(until?)),
                Err(_) => self.conn.rebuild(generation),
            }
        }
        Err(StoreError::unavailable(RenewalTimedOut(
            deadline.saturating_duration_since(started),
        )))
    }

    /// [`RedisStore::extend`] bounds itself (an eighth of the lease on the current
    /// connection, then a new connection, within seven sixteenths), so a renewal is one call.
    async fn renew(
        &self,
        key: &RecordKey,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<SystemTime, StoreError> {
        self.extend(key, token, lease).await
    }

    /// Redis deletes each record when its ttl passes (`PEXPIREAT`): nothing to purge.
    async fn purge_expired(&self, _batch: usize) -> Result<u64, StoreError> {
        Ok(0)
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        match self
            .run(&scripts().get, &[&self.redis_key(key)], &[])
            .await?
        {
            Value::Nil => Ok(None),
            v => record_from(key, &array(v)?, 0).map(Some),
        }
    }

    async fn delete(&self, key: &RecordKey, force: bool) -> Result<Deleted, StoreError> {
        let force: &[u8] = if force { b"1" } else { b"0" };
        let keys = self.keys(key);
        match self.run(&scripts().delete, &keys.all(), &[force]).await? {
            Value::Nil => Ok(Deleted::Absent),
            v => {
                let f = array(v)?;
                let record = record_from(key, &f, 1)?;
                Ok(if int(&f, 0)? == 1 {
                    Deleted::Deleted(record)
                } else {
                    Deleted::InProgress(record)
                })
            }
        }
    }

    fn changes(&self) -> Option<&crate::store::Changes> {
        Some(&self.changes)
    }

    fn expires_by_itself(&self) -> bool {
        true
    }
}

/// A claim or a completion that fewer replicas acknowledged than
/// [`RedisStoreBuilder::wait_for_replicas`] asks for.
#[derive(Debug, thiserror::Error)]
#[error("the write was not acknowledged by enough replicas in time")]
struct NotReplicated;

/// `url` with any user and password in it replaced by `***`, for errors and logs.
fn without_credentials(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let end = rest.find('/').unwrap_or(rest.len());
    let (authority, path) = rest.split_at(end);
    match authority.rfind('@') {
        Some(at) => format!("{scheme}://***@{}{path}", &authority[at + 1..]),
        None => url.to_owned(),
    }
}

/// The keys of one record's scripts (see [`RedisStore::redis_key`]).
struct Keys {
    record: Vec<u8>,
    /// A counted scope's sorted set of records and hash of charges.
    usage: Option<(Vec<u8>, Vec<u8>)>,
}

impl Keys {
    /// The record's key, then its scope's usage keys if it has them.
    fn all(&self) -> Vec<&[u8]> {
        let mut keys = vec![self.record.as_slice()];
        if let Some((members, charges)) = &self.usage {
            keys.push(members);
            keys.push(charges);
        }
        keys
    }
}

/// A lease renewal that got no answer in time, on its connection and on a new one.
#[derive(Debug, thiserror::Error)]
#[error("no answer to a lease renewal within {0:?}, on its connection and on a new one")]
struct RenewalTimedOut(Duration);

/// Every claim attempt found the record changed under it.
#[derive(Debug, thiserror::Error)]
#[error("claim gave up after {MAX_CLAIM_ATTEMPTS} attempts under contention")]
struct Contention;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{key::IdempotencyKey, scope::Scope};

    fn store() -> RedisStore {
        // The key layout needs no connection; a store over a lazy client is enough.
        let client = redis::Client::open("redis://127.0.0.1:1").expect("url");
        let config = redis::aio::ConnectionManagerConfig::new();
        let conn =
            ConnectionManager::new_lazy_with_config(client.clone(), config.clone()).expect("lazy");
        let conn = Rebuilt::new(
            Box::new(move || {
                let lazy = ConnectionManager::new_lazy_with_config(client.clone(), config.clone());
                Box::pin(std::future::ready(lazy))
            }),
            conn,
            connection::REBUILD_INTERVAL,
        );
        RedisStore::new(
            Conn::Single(std::sync::Arc::new(conn)),
            None,
            "p:".to_owned(),
            None,
            Duration::from_secs(5),
            RedisStoreBuilder::default().bounds,
            (Vec::new(), Duration::from_secs(1)),
        )
    }

    fn key(scope: &str, key: &str) -> RecordKey {
        RecordKey::new(
            Scope::new(scope).expect("scope"),
            IdempotencyKey::parse(key.as_bytes()).expect("key"),
        )
    }

    /// The hash tag Redis Cluster hashes: between the first `{` and the first `}` after it.
    fn tag(k: &[u8]) -> &[u8] {
        let open = k.iter().position(|&b| b == b'{').expect("{");
        let close = open + k[open..].iter().position(|&b| b == b'}').expect("}");
        &k[open + 1..close]
    }

    /// Settings are checked before anything connects (the port here answers nothing).
    #[tokio::test]
    async fn bad_settings_are_refused_before_connecting() {
        let url = "redis://127.0.0.1:1";
        let second = Duration::from_secs(1);
        for (builder, url) in [
            (RedisStore::builder().wait_for_replicas(0, second), url),
            (
                RedisStore::builder().wait_for_replicas(1, Duration::ZERO),
                url,
            ),
            // The wait must end before the answer is given up on.
            (
                RedisStore::builder()
                    .response_timeout(second)
                    .wait_for_replicas(1, second),
                url,
            ),
            (
                RedisStore::builder().wait_for_replicas(1, Duration::MAX),
                "redis+cluster://127.0.0.1:1",
            ),
        ] {
            assert!(matches!(
                builder.connect(url).await,
                Err(RedisSetupError::InvalidWait)
            ));
        }
        for prefix in ["a{b", "a}b", "a b", &"x".repeat(65)] {
            assert!(matches!(
                RedisStore::builder().prefix(prefix).connect(url).await,
                Err(RedisSetupError::InvalidPrefix(_))
            ));
        }
        for url in ["http://x", "redis+cluster://", "postgres://x", ""] {
            assert!(matches!(
                RedisStore::connect(url).await,
                Err(RedisSetupError::InvalidUrl(_))
            ));
        }
    }

    #[test]
    fn the_scripts_charge_records_as_the_store_does() {
        assert!(scripts::USAGE.contains(&format!(
            "local RECORD_OVERHEAD = {}\n",
            RedisStore::RECORD_OVERHEAD
        )));
        assert_eq!(RedisStore::charge(b"k", u64::MAX), u64::MAX);
    }

    #[test]
    fn urls_in_errors_carry_no_credentials() {
        assert_eq!(
            without_credentials("redis+clusterx://user:s3cret@h:1/0"),
            "redis+clusterx://***@h:1/0"
        );
        assert_eq!(without_credentials("redis://:pw@h:1"), "redis://***@h:1");
        assert_eq!(without_credentials("redis://h:1/0"), "redis://h:1/0");
        assert_eq!(without_credentials("not a url"), "not a url");
    }

    #[tokio::test]
    async fn keys_never_collide_and_a_callers_tag_is_its_scope() {
        let s = store();
        let pairs = [
            ("a:b", "c"),
            ("a", "b:c"),
            ("a:", "b:c"),
            ("a", ":b:c"),
            ("a}", "b"),
            ("a", "}b"),
            ("a%7D", "b"),
            ("a%", "7Db"),
            ("1:a", "b"),
            ("1", ":a:b"),
            ("a", "#z"),
            ("a", "b}#u"),
        ];
        let mut all: Vec<Vec<u8>> = Vec::new();
        for (sc, k) in pairs {
            let keys = s.keys(&key(sc, k));
            let (members, charges) = keys.usage.clone().expect("a caller's scope is counted");
            // One `}`: the one that closes the tag, and the tag is the escaped scope alone,
            // for the record and its scope's usage alike (one slot, one atomic script).
            for k in [&keys.record, &members, &charges] {
                assert!(k.starts_with(b"p:{"), "{k:?}");
                assert_eq!(k.iter().filter(|&&b| b == b'}').count(), 1, "{k:?}");
                assert_eq!(tag(k), tag(&keys.record));
            }
            assert_eq!(keys.record[p_len(&keys.record)], b':');
            all.push(keys.record);
            for usage in [members, charges] {
                if !all.contains(&usage) {
                    all.push(usage);
                }
            }
        }
        // Unscoped namespaces: the tag is the whole record key, so they spread; no usage.
        let shared = s.keys(&RecordKey::new(
            Scope::unscoped(),
            IdempotencyKey::parse(b"a").unwrap(),
        ));
        assert!(shared.usage.is_none());
        assert_eq!(shared.record, b"p:{0::a}".to_vec());
        assert_eq!(
            tag(&shared.record),
            &shared.record[3..shared.record.len() - 1]
        );
        all.push(shared.record);
        for (i, a) in all.iter().enumerate() {
            for b in &all[i + 1..] {
                assert_ne!(a, b, "two keys collide");
            }
        }
        assert_eq!(s.redis_key(&key("a}", "b")), b"p:{4:a%7D}:b".to_vec());
        assert_eq!(
            s.keys(&key("a", "b")).usage.unwrap().0,
            b"p:{1:a}#z".to_vec()
        );
    }

    /// Where a key's hash tag ends.
    fn p_len(k: &[u8]) -> usize {
        k.iter().position(|&b| b == b'}').expect("}") + 1
    }
}
