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
use redis::Value;
use redis::aio::ConnectionManager;
use redis::cluster_async::ClusterConnection;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

/// The longest lease or ttl the store writes: 1,000 years in milliseconds (longer ones are cut
/// to it, so an absurd setting can never overflow the server's expiry arithmetic).
const MAX_MILLIS: i64 = 1_000 * 365 * 24 * 3600 * 1000;

/// How often a claim runs again when the record changed between its claim script and its
/// take-over script (each time, another attempt made progress).
const MAX_CLAIM_ATTEMPTS: usize = 16;

/// The server's clock in whole milliseconds, as every script reads it. `TIME` is allowed
/// before writes because scripts replicate their effects (the default since Redis 5, the only
/// mode since 7), so replicas apply the writes, never re-run the clock.
const NOW: &str = "local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function ms(x) return string.format('%d', x) end
";

/// A counted scope's usage (see [`RedisStore`]'s "Per caller bounds"): when a script gets three
/// keys, `KEYS[2]` is the scope's sorted set of its records, each scored by when it next needs
/// looking at (its lease's end while in progress, its expiry once done), and `KEYS[3]` the
/// hash of what each is charged (and, under the field ` bytes`, which no record key can be,
/// their sum). With one key (the unscoped namespaces) these do nothing. Every script that
/// changes a record's lease, expiry or charge, or deletes it, keeps them in step, in the same
/// atomic script. Later claims sweep the records whose score passed: one Redis expired is
/// dropped; one whose lease ran out (its execution crashed, or gave up on its complete) keeps
/// its record's charge but gives its reservation back. (The sweep reads those records' keys:
/// they share the scope's hash tag, so its slot.)
const USAGE: &str = "
local RECORD_OVERHEAD = 320
local counted = #KEYS == 3
local function keep_until(ex)
  for i = 2, 3 do
    local left = redis.call('PTTL', KEYS[i])
    if left < 0 or now + left < ex then redis.call('PEXPIREAT', KEYS[i], ms(ex)) end
  end
end
local function usage_sweep(limit)
  local due = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, limit)
  if #due == 0 then return end
  local freed, gone = 0, {}
  for _, m in ipairs(due) do
    local charge = tonumber(redis.call('HGET', KEYS[3], m)) or 0
    local rec = redis.call('HMGET', m, 'done', 'ex')
    local ex = tonumber(rec[2])
    if not ex or ex <= now then
      freed = freed + charge
      table.insert(gone, m)
    else
      if rec[1] == '0' then
        local base = RECORD_OVERHEAD + 3 * string.len(m)
        if charge > base then
          redis.call('HSET', KEYS[3], m, base)
          freed = freed + charge - base
        end
      end
      redis.call('ZADD', KEYS[2], ex, m)
    end
  end
  if #gone > 0 then
    redis.call('HDEL', KEYS[3], unpack(gone))
    redis.call('ZREM', KEYS[2], unpack(gone))
  end
  redis.call('HINCRBY', KEYS[3], ' bytes', -freed)
end
-- The record's charge is `charge`; it next needs looking at `due` (its lease's end while in
-- progress, its expiry once done), and lives until `ex`.
local function usage_set(charge, due, ex)
  if not counted then return end
  local old = tonumber(redis.call('HGET', KEYS[3], KEYS[1])) or 0
  redis.call('HSET', KEYS[3], KEYS[1], charge)
  redis.call('HINCRBY', KEYS[3], ' bytes', charge - old)
  redis.call('ZADD', KEYS[2], due, KEYS[1])
  keep_until(ex)
end
local function usage_renewed(due, ex)
  if not counted then return end
  redis.call('ZADD', KEYS[2], 'XX', due, KEYS[1])
  keep_until(ex)
end
local function usage_drop()
  if not counted then return end
  local old = tonumber(redis.call('HGET', KEYS[3], KEYS[1]))
  if old then
    redis.call('HDEL', KEYS[3], KEYS[1])
    redis.call('ZREM', KEYS[2], KEYS[1])
    redis.call('HINCRBY', KEYS[3], ' bytes', -old)
  end
end
-- Whether a new record charged `charge` fits its scope's bounds: nil, or why not (0: records,
-- 1: bytes). Expired records are swept out first: a few each time, all (bounded) when full.
local function usage_refuses(charge, max_bytes, max_records)
  if not counted then return nil end
  local function refuses()
    if redis.call('ZCARD', KEYS[2]) >= max_records then return 0 end
    local held = tonumber(redis.call('HGET', KEYS[3], ' bytes')) or 0
    if held + charge > max_bytes then return 1 end
    return nil
  end
  usage_sweep(16)
  if refuses() == nil then return nil end
  usage_sweep(1000)
  return refuses()
end
";

/// Claims an absent key (`{1, locked_until}`), or reports the record that holds it
/// (`{0, fingerprint, token, done, expired, lease_over, retry_ms, status, headers, body,
/// oversized}`, times compared on the server's clock), or refuses a new record its scope has
/// no room for (`{2, 0}`: records, `{2, 1}`: bytes). Never writes to an existing record.
/// ARGV: fingerprint, token, lease ms, expiry ms (lease + ttl), then for a counted scope the
/// record's charge (its reservation), the scope's byte and record bounds.
const CLAIM: &str = "
local r = redis.call('HMGET', KEYS[1], 'fp', 'tok', 'done', 'lu', 'ex', 'st', 'hd', 'bd', 'ov')
if r[2] == ARGV[2] and r[3] == '0' and (tonumber(r[4]) or 0) > now then
  -- This very claim, sent again (the client retried a request whose answer it lost). The
  -- token is written again, unchanged: a write that replicates after the first, so the
  -- `WAIT` after it covers the claim whatever connection it runs on.
  redis.call('HSET', KEYS[1], 'tok', ARGV[2])
  return {1, tonumber(r[4])}
end
if not r[1] then
  if counted then
    local why = usage_refuses(tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7]))
    if why then return {2, why} end
  end
  local lu = now + tonumber(ARGV[3])
  local ex = now + tonumber(ARGV[4])
  redis.call('HSET', KEYS[1], 'fp', ARGV[1], 'tok', ARGV[2], 'done', '0', 'lu', ms(lu),
    'ca', ms(now), 'ex', ms(ex))
  redis.call('PEXPIREAT', KEYS[1], ms(ex))
  usage_set(tonumber(ARGV[5]), lu, ex)
  return {1, lu}
end
local ex = tonumber(r[5]) or 0
local lu = tonumber(r[4]) or 0
local done = r[3] == '1'
local retry = 0
if not done and lu > now then retry = lu - now end
return {0, r[1], r[2], done and 1 or 0, (ex <= now) and 1 or 0,
  (not done and lu <= now) and 1 or 0, retry, r[6], r[7], r[8], r[9]}
";

/// The rare path: takes over a record whose ttl passed or whose lease ran out, only while it
/// still carries the token the claim read (compare-and-swap: of two take-overs at once, one
/// matches). Returns the new lease end, or nil when the record changed meanwhile.
/// ARGV: old token, fingerprint, new token, lease ms, expiry ms, then for a counted scope the
/// new claim's charge (it replaces the old claim's).
const TAKE_OVER: &str = "
local r = redis.call('HMGET', KEYS[1], 'tok', 'done', 'lu', 'ex')
if r[1] == ARGV[3] and r[2] == '0' and (tonumber(r[3]) or 0) > now then
  -- This very take-over, sent again: as in the claim, a write for the `WAIT` to cover.
  redis.call('HSET', KEYS[1], 'tok', ARGV[3])
  return tonumber(r[3])
end
if r[1] ~= ARGV[1] then return false end
local ex = tonumber(r[4]) or 0
local lu = tonumber(r[3]) or 0
if not (ex <= now or (r[2] == '0' and lu <= now)) then return false end
redis.call('DEL', KEYS[1])
local nlu = now + tonumber(ARGV[4])
local nex = now + tonumber(ARGV[5])
redis.call('HSET', KEYS[1], 'fp', ARGV[2], 'tok', ARGV[3], 'done', '0', 'lu', ms(nlu),
  'ca', ms(now), 'ex', ms(nex))
redis.call('PEXPIREAT', KEYS[1], ms(nex))
usage_set(tonumber(ARGV[6]), nlu, nex)
return nlu
";

/// The fence every write after the claim passes: the record exists, is in progress, is not
/// past its ttl and carries ARGV[1]. Sets `ex` to its expiry.
const FENCE: &str = "
local f = redis.call('HMGET', KEYS[1], 'tok', 'done', 'ex')
local ex = tonumber(f[3]) or 0
if f[1] ~= ARGV[1] or f[2] ~= '0' or ex <= now then return 0 end
";

/// With `wait_for_replicas` only, after a completion the fence refused: whether the record is
/// done by this very token (ARGV[1]: a retry of a completion whose answer or `WAIT` failed),
/// 1 or 0. It then writes its completion time again, unchanged: a write that replicates after
/// the first completion, so the `WAIT` after it covers that completion even on a new
/// connection (whose own last write would otherwise be none, and whose `WAIT` would count
/// replicas that never received it).
const CONFIRM: &str = "
local d = redis.call('HMGET', KEYS[1], 'tok', 'done', 'co')
if d[1] == ARGV[1] and d[2] == '1' then
  redis.call('HSET', KEYS[1], 'co', d[3] or '0')
  return 1
end
return 0
";

/// Fenced: the record becomes done with the outcome; expires no sooner than ttl after now.
/// ARGV: token, status, headers, body, oversized size or '', ttl ms, then for a counted scope
/// what the stored record is charged (it settles the claim's reservation). Returns 1, or 0
/// (stale).
const COMPLETE: &str = "
local nex = math.max(ex, now + tonumber(ARGV[6]))
redis.call('HSET', KEYS[1], 'done', '1', 'st', ARGV[2], 'hd', ARGV[3], 'bd', ARGV[4],
  'co', ms(now), 'ex', ms(nex))
if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'ov', ARGV[5]) end
redis.call('HDEL', KEYS[1], 'lu')
redis.call('PEXPIREAT', KEYS[1], ms(nex))
usage_set(tonumber(ARGV[7]), nex, nex)
return 1
";

/// Fenced: deletes the record. ARGV: token. Returns 1, or 0 (stale).
const RELEASE: &str = "
redis.call('DEL', KEYS[1])
usage_drop()
return 1
";

/// Fenced heartbeat: the lease ends lease ms after now, and the record lives at least as long.
/// ARGV: token, lease ms. Returns the new lease end, or 0 (stale).
const EXTEND: &str = "
local lu = now + tonumber(ARGV[2])
local nex = math.max(ex, lu)
redis.call('HSET', KEYS[1], 'lu', ms(lu), 'ex', ms(nex))
redis.call('PEXPIREAT', KEYS[1], ms(nex))
usage_renewed(lu, nex)
return lu
";

/// The fields `get` and `delete` report, in this order.
const FIELDS: &str = "'fp', 'tok', 'done', 'lu', 'st', 'hd', 'bd', 'ov', 'ca', 'co', 'ex'";

/// Reads a live record: its fields, or nil when absent or past its ttl.
fn get_script() -> String {
    format!(
        "{NOW}
local r = redis.call('HMGET', KEYS[1], {FIELDS})
if not r[1] or (tonumber(r[11]) or 0) <= now then return false end
return r"
    )
}

/// Deletes a record that is done, past its ttl, or in progress with ARGV[1] = '1' (force), in
/// one step with the check. Returns nil (absent) or `{deleted 1|0, fields…}`.
fn delete_script() -> String {
    format!(
        "{NOW}{USAGE}
local r = redis.call('HMGET', KEYS[1], {FIELDS})
if not r[1] then return false end
local deleted = 0
if r[3] == '1' or (tonumber(r[11]) or 0) <= now or ARGV[1] == '1' then
  redis.call('DEL', KEYS[1])
  usage_drop()
  deleted = 1
end
table.insert(r, 1, deleted)
return r"
    )
}

/// The store's scripts (each sent by SHA once the server has it: `EVALSHA`, loading it on
/// `NOSCRIPT`, which a new primary after a failover answers once).
#[derive(Debug)]
struct Scripts {
    claim: redis::Script,
    take_over: redis::Script,
    complete: redis::Script,
    confirm: redis::Script,
    /// The sources of the four above, sent whole (`EVAL`) in a pipeline with their `WAIT`.
    claim_src: String,
    take_over_src: String,
    complete_src: String,
    confirm_src: String,
    release: redis::Script,
    extend: redis::Script,
    get: redis::Script,
    delete: redis::Script,
}

impl Scripts {
    fn new() -> Self {
        let fenced = |body: &str| redis::Script::new(&format!("{NOW}{USAGE}{FENCE}{body}"));
        let claim_src = format!("{NOW}{USAGE}{CLAIM}");
        let take_over_src = format!("{NOW}{USAGE}{TAKE_OVER}");
        let complete_src = format!("{NOW}{USAGE}{FENCE}{COMPLETE}");
        let confirm_src = CONFIRM.to_owned();
        Scripts {
            claim: redis::Script::new(&claim_src),
            take_over: redis::Script::new(&take_over_src),
            complete: redis::Script::new(&complete_src),
            confirm: redis::Script::new(&confirm_src),
            claim_src,
            take_over_src,
            complete_src,
            confirm_src,
            release: fenced(RELEASE),
            extend: fenced(EXTEND),
            get: redis::Script::new(&get_script()),
            delete: redis::Script::new(&delete_script()),
        }
    }
}

fn scripts() -> &'static Scripts {
    static SCRIPTS: std::sync::OnceLock<Scripts> = std::sync::OnceLock::new();
    SCRIPTS.get_or_init(Scripts::new)
}

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

/// The connection: a reconnecting multiplexed connection to one server, or the cluster
/// client's (one multiplexed connection per node, following `MOVED`/`ASK` and refreshing its
/// slot map after a failover); each rebuilt after a failure (see [`Rebuilt`]).
#[derive(Clone)]
enum Conn {
    Single(std::sync::Arc<Rebuilt<ConnectionManager>>),
    Cluster(std::sync::Arc<Rebuilt<ClusterConnection>>),
}

/// Opens a new connection of type `C`.
type Connector<C> = Box<
    dyn Fn() -> std::pin::Pin<Box<dyn Future<Output = redis::RedisResult<C>> + Send>> + Send + Sync,
>;

/// A connection and how to open another, which replaces it in the background after a
/// failure that is not the server's own answer (I/O, a timeout, a lost connection; see
/// [`needs_new_connection`]). Neither of the `redis` crate's connections recovers by itself
/// from every such failure:
/// - under load, its cluster connection did not recover from a primary killed with SIGKILL
///   (its requests to that shard kept timing out after the replica took over and the node came
///   back as a replica; measured for minutes): the new one reads the cluster's current slot
///   map from the seed nodes;
/// - its `ConnectionManager` reconnects when its connection is closed, not when it stops
///   answering: a connection that stays open but silent (a network that drops packets, a
///   half-open connection, a cluster connection stuck after a failover) would time out every
///   command until the operating system gave up on it, hours later.
///
/// Each connection has a generation. Only a failure on the current generation starts a
/// rebuild (a late failure on a connection already replaced does not replace its successor),
/// one rebuild runs at a time, and rebuilds start at most every `interval`
/// ([`REBUILD_INTERVAL`]).
struct Rebuilt<C> {
    connect: Connector<C>,
    /// The current connection and its generation.
    current: std::sync::RwLock<(C, u64)>,
    /// The current generation, for those waiting for a new connection.
    generation: tokio::sync::watch::Sender<u64>,
    /// Whether a rebuild runs, and when the last one started.
    rebuilding: std::sync::Mutex<(bool, Option<std::time::Instant>)>,
    interval: Duration,
}

/// The shortest time between the starts of two rebuilds of one connection (a server that
/// refuses connections is not asked again at once by every failing command).
const REBUILD_INTERVAL: Duration = Duration::from_millis(100);

/// Marks a rebuild of its connection as ended when dropped: when it finished, failed,
/// panicked, or its future was dropped unfinished (its runtime shut down, or none to run it).
struct RebuildEnds<C>(std::sync::Arc<Rebuilt<C>>);

impl<C> Drop for RebuildEnds<C> {
    fn drop(&mut self) {
        self.0
            .rebuilding
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .0 = false;
    }
}

impl<C: Clone + Send + Sync + 'static> Rebuilt<C> {
    async fn connect(connect: Connector<C>) -> Result<Self, redis::RedisError> {
        let conn = connect().await?;
        Ok(Self::new(connect, conn, REBUILD_INTERVAL))
    }

    fn new(connect: Connector<C>, conn: C, interval: Duration) -> Self {
        Rebuilt {
            connect,
            current: std::sync::RwLock::new((conn, 0)),
            generation: tokio::sync::watch::Sender::new(0),
            rebuilding: std::sync::Mutex::new((false, None)),
            interval,
        }
    }

    /// The current connection and its generation.
    fn conn(&self) -> (C, u64) {
        self.current
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Rebuilds the connection in the background after a failure on generation `failed`,
    /// unless that connection was replaced already, a rebuild runs, or the last one started
    /// less than the interval ago.
    fn rebuild(self: &std::sync::Arc<Self>, failed: u64) {
        {
            let mut state = self
                .rebuilding
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            // Checked under the lock: a rebuild that ends meanwhile changes the generation
            // before it clears `running`.
            if *self.generation.borrow() != failed {
                return;
            }
            let (running, last) = &mut *state;
            if *running || last.is_some_and(|t| t.elapsed() < self.interval) {
                return;
            }
            *running = true;
            *last = Some(std::time::Instant::now());
        }
        let ends = RebuildEnds(std::sync::Arc::clone(self));
        let rebuild = async move {
            let this = &ends.0;
            match (this.connect)().await {
                Ok(conn) => {
                    let generation = {
                        let mut current = this
                            .current
                            .write()
                            .unwrap_or_else(std::sync::PoisonError::into_inner);
                        *current = (conn, current.1 + 1);
                        current.1
                    };
                    this.generation.send_replace(generation);
                    tracing::info!("redis store: connection rebuilt after a failure");
                }
                Err(e) => {
                    tracing::warn!("redis store: rebuilding the connection failed: {e}");
                }
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn(rebuild)),
            // No runtime to run it on: dropped unstarted, it still ends the rebuild it marked.
            Err(_) => drop(rebuild),
        }
    }

    /// Whether generation `old` was replaced, or a rebuild runs.
    fn replacing(&self, old: u64) -> bool {
        *self.generation.borrow() != old
            || self
                .rebuilding
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0
    }

    /// Waits until a connection newer than generation `old` is in place, at most until
    /// `deadline`, asking again every interval for a rebuild (one can fail, or be skipped
    /// for the interval); whether one is.
    async fn replaced(
        self: &std::sync::Arc<Self>,
        old: u64,
        deadline: tokio::time::Instant,
    ) -> bool {
        let mut generation = self.generation.subscribe();
        loop {
            let every = self.interval.max(Duration::from_millis(1));
            let next = (tokio::time::Instant::now() + every).min(deadline);
            match tokio::time::timeout_at(next, generation.wait_for(|g| *g != old)).await {
                Ok(changed) => return changed.is_ok(),
                Err(_) if next >= deadline => return false,
                Err(_) => self.rebuild(old),
            }
        }
    }
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
        }
    }
}

impl RedisStoreBuilder {
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
        ))
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
    ) -> Self {
        RedisStore {
            conn,
            durable,
            prefix: prefix.into(),
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
        let mut tag =
            Vec::with_capacity(self.prefix.len() + scope.len() + key.key.as_str().len() + 16);
        tag.extend_from_slice(self.prefix.as_bytes());
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
    /// two scripts) and, with a wait, how many replicas acknowledged the script that decided it.
    async fn claim_once(
        &self,
        keys: &Keys,
        req: &ClaimRequest<'_>,
    ) -> Result<(Option<ClaimOutcome>, Option<u32>), StoreError> {
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
            1 => return Ok((Some(claimed(token, int(&fields, 1)?, false)), acked)),
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
            Decision::Report(outcome) => Ok((Some(outcome), acked)),
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
                    v => Ok((Some(claimed(token, num(&v)?, true)), acked)),
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

/// The store error for a client error on generation `generation` of `conn`; a failure of the
/// connection rather than the server's answer also rebuilds it (see [`Rebuilt`]).
fn failed(conn: &Conn, generation: u64, e: redis::RedisError) -> StoreError {
    if needs_new_connection(&e) {
        conn.rebuild(generation);
    }
    redis_error(e)
}

/// Whether `e` says the connection failed (I/O, a timeout, a lost or refused connection, a
/// reply it could not parse, a cluster node it has no connection to), not the server's own
/// answer: server errors the `redis` crate does not know by name (`WRONGTYPE`, `BUSY`, `OOM`,
/// `NOREPLICAS`) come as [`redis::ErrorKind::Extension`] and keep the connection.
fn needs_new_connection(e: &redis::RedisError) -> bool {
    e.is_io_error() || e.is_unrecoverable_error()
}

impl Conn {
    /// The current connection's generation (see [`Rebuilt`]).
    fn generation(&self) -> u64 {
        match self {
            Conn::Single(c) => c.conn().1,
            Conn::Cluster(c) => c.conn().1,
        }
    }

    /// Whether generation `old` was replaced, or a rebuild runs.
    fn replacing(&self, old: u64) -> bool {
        match self {
            Conn::Single(c) => c.replacing(old),
            Conn::Cluster(c) => c.replacing(old),
        }
    }

    /// Replaces the connection after a failure on generation `failed` (see [`Rebuilt`]).
    fn rebuild(&self, failed: u64) {
        match self {
            Conn::Single(c) => c.rebuild(failed),
            Conn::Cluster(c) => c.rebuild(failed),
        }
    }

    /// Waits for a connection newer than generation `old`, at most until `deadline` (see
    /// [`Rebuilt::replaced`]).
    async fn replaced(&self, old: u64, deadline: tokio::time::Instant) -> bool {
        match self {
            Conn::Single(c) => c.replaced(old, deadline).await,
            Conn::Cluster(c) => c.replaced(old, deadline).await,
        }
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
        let keys = self.keys(req.key);
        for _ in 0..MAX_CLAIM_ATTEMPTS {
            let (Some(outcome), acked) = self.claim_once(&keys, &req).await? else {
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
            return Ok(outcome);
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
            REBUILD_INTERVAL,
        );
        RedisStore::new(
            Conn::Single(std::sync::Arc::new(conn)),
            None,
            "p:".to_owned(),
            None,
            Duration::from_secs(5),
            RedisStoreBuilder::default().bounds,
        )
    }

    /// A connection that is only a number: the `n`th one opened; each opening waits for
    /// `gate` when there is one.
    fn numbered(
        interval: Duration,
        gate: Option<std::sync::Arc<tokio::sync::Semaphore>>,
    ) -> (
        std::sync::Arc<Rebuilt<u32>>,
        std::sync::Arc<std::sync::atomic::AtomicU32>,
    ) {
        let opened = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
        let counted = std::sync::Arc::clone(&opened);
        let conn = Rebuilt::new(
            Box::new(move || {
                let (opened, gate) = (std::sync::Arc::clone(&opened), gate.clone());
                Box::pin(async move {
                    if let Some(gate) = gate {
                        gate.acquire().await.expect("open").forget();
                    }
                    Ok(opened.fetch_add(1, Ordering::SeqCst) + 1)
                })
            }),
            0,
            interval,
        );
        (std::sync::Arc::new(conn), counted)
    }

    fn soon() -> tokio::time::Instant {
        tokio::time::Instant::now() + Duration::from_secs(5)
    }

    #[tokio::test]
    async fn a_late_failure_of_a_replaced_connection_leaves_its_successor() {
        let (conn, opened) = numbered(Duration::ZERO, None);
        assert_eq!(conn.conn(), (0, 0));
        conn.rebuild(0);
        assert!(conn.replaced(0, soon()).await);
        assert_eq!(conn.conn(), (1, 1));
        conn.rebuild(0);
        tokio::task::yield_now().await;
        assert_eq!(conn.conn(), (1, 1));
        assert_eq!(opened.load(Ordering::SeqCst), 1, "a stale failure rebuilt");
        conn.rebuild(1);
        assert!(conn.replaced(1, soon()).await);
        assert_eq!(conn.conn(), (2, 2));
    }

    #[tokio::test]
    async fn rebuilds_wait_out_the_interval() {
        let (conn, opened) = numbered(Duration::from_secs(3600), None);
        conn.rebuild(0);
        assert!(conn.replaced(0, soon()).await);
        conn.rebuild(1);
        let waited = tokio::time::Instant::now() + Duration::from_millis(50);
        assert!(!conn.replaced(1, waited).await);
        assert_eq!(opened.load(Ordering::SeqCst), 1);
        assert_eq!(conn.conn(), (1, 1));
    }

    #[tokio::test]
    async fn one_rebuild_runs_at_a_time() {
        let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
        let (conn, opened) = numbered(Duration::ZERO, Some(std::sync::Arc::clone(&gate)));
        conn.rebuild(0);
        for _ in 0..5 {
            tokio::task::yield_now().await;
            conn.rebuild(0);
        }
        gate.add_permits(10);
        assert!(conn.replaced(0, soon()).await);
        for _ in 0..5 {
            tokio::task::yield_now().await;
        }
        assert_eq!(
            opened.load(Ordering::SeqCst),
            1,
            "rebuilds ran side by side"
        );
        assert_eq!(conn.conn(), (1, 1));
    }

    /// What a renewal that failed at once asks: is its connection being replaced (then it
    /// waits for the new one), or did the server refuse it (then it reports that)?
    #[tokio::test]
    async fn replacing_says_whether_a_failed_connection_is_being_replaced() {
        let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
        let (conn, _) = numbered(Duration::ZERO, Some(std::sync::Arc::clone(&gate)));
        assert!(!conn.replacing(0), "nothing failed");
        conn.rebuild(0);
        assert!(conn.replacing(0), "a rebuild runs");
        gate.add_permits(1);
        assert!(conn.replaced(0, soon()).await);
        assert!(conn.replacing(0), "generation 0 was replaced");
        assert!(
            !conn.replacing(1),
            "the new connection is not being replaced"
        );
    }

    #[test]
    fn a_rebuild_with_no_runtime_to_run_on_does_not_block_the_next() {
        let (conn, opened) = numbered(Duration::ZERO, None);
        conn.rebuild(0);
        assert!(
            !conn.rebuilding.lock().expect("lock").0,
            "left marked as running"
        );
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            conn.rebuild(0);
            assert!(conn.replaced(0, soon()).await);
        });
        assert_eq!(opened.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn the_servers_own_errors_keep_the_connection() {
        use redis::{ErrorKind, RedisError};
        let io = |kind| RedisError::from(std::io::Error::from(kind));
        assert!(needs_new_connection(&io(std::io::ErrorKind::TimedOut)));
        assert!(needs_new_connection(&io(
            std::io::ErrorKind::ConnectionReset
        )));
        assert!(needs_new_connection(&RedisError::from((
            ErrorKind::ClusterConnectionNotFound,
            "no connection to the node"
        ))));
        for kept in [
            RedisError::from((ErrorKind::Extension, "WRONGTYPE", "not a hash".to_owned())),
            RedisError::from((ErrorKind::Extension, "BUSY", "a script runs".to_owned())),
            RedisError::from((ErrorKind::UnexpectedReturnType, "not an array")),
        ] {
            assert!(!needs_new_connection(&kept), "{kept}");
        }
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
        assert!(USAGE.contains(&format!(
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
