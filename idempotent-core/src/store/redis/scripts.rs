//! The Redis store's Lua scripts: one per operation, each atomic on the node that owns its
//! record's slot, with the fence and the caller's usage kept in the same script.

/// The server's clock in whole milliseconds, as every script reads it. `TIME` is allowed
/// before writes because scripts replicate their effects (the default since Redis 5, the only
/// mode since 7), so replicas apply the writes, never re-run the clock.
pub(super) const NOW: &str = "local t = redis.call('TIME')
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
pub(super) const USAGE: &str = "
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
pub(super) const CLAIM: &str = "
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
-- A done record has no lease: what is left of its life instead (a replay cache's bound).
if done and ex > now then retry = ex - now end
return {0, r[1], r[2], done and 1 or 0, (ex <= now) and 1 or 0,
  (not done and lu <= now) and 1 or 0, retry, r[6], r[7], r[8], r[9]}
";

/// The rare path: takes over a record whose ttl passed or whose lease ran out, only while it
/// still carries the token the claim read (compare-and-swap: of two take-overs at once, one
/// matches). Returns the new lease end, or nil when the record changed meanwhile.
/// ARGV: old token, fingerprint, new token, lease ms, expiry ms, then for a counted scope the
/// new claim's charge (it replaces the old claim's).
pub(super) const TAKE_OVER: &str = "
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
pub(super) const FENCE: &str = "
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
pub(super) const CONFIRM: &str = "
local d = redis.call('HMGET', KEYS[1], 'tok', 'done', 'co')
if d[1] == ARGV[1] and d[2] == '1' then
  redis.call('HSET', KEYS[1], 'co', d[3] or '0')
  return 1
end
return 0
";

/// Fenced: the record becomes done with the outcome; expires no sooner than ttl after now; its
/// waiters, if one marked it (`MARK`), are woken (`listen`).
/// ARGV: token, status, headers, body, oversized size or '', ttl ms, then for a counted scope
/// what the stored record is charged (it settles the claim's reservation). Returns 1, or 0
/// (stale).
pub(super) const COMPLETE: &str = "
local nex = math.max(ex, now + tonumber(ARGV[6]))
redis.call('HSET', KEYS[1], 'done', '1', 'st', ARGV[2], 'hd', ARGV[3], 'bd', ARGV[4],
  'co', ms(now), 'ex', ms(nex))
if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'ov', ARGV[5]) end
redis.call('HDEL', KEYS[1], 'lu')
redis.call('PEXPIREAT', KEYS[1], ms(nex))
usage_set(tonumber(ARGV[7]), nex, nex)
if redis.call('HGET', KEYS[1], 'w') then redis.call('PUBLISH', 'idempotent:changes', KEYS[1]) end
return 1
";

/// Fenced: deletes the record, and wakes its waiters if one marked it (`MARK`). ARGV: token.
/// Returns 1, or 0 (stale).
pub(super) const RELEASE: &str = "
local waited = redis.call('HGET', KEYS[1], 'w')
redis.call('DEL', KEYS[1])
usage_drop()
if waited then redis.call('PUBLISH', 'idempotent:changes', KEYS[1]) end
return 1
";

/// A request waits on the record (in progress): marked (`w`), so its complete or release
/// publishes (`listen`); nothing else publishes, so a first execution nobody waits on sends no
/// message (on a Cluster, one that would cross the cluster bus to every node).
pub(super) const MARK: &str = "
if redis.call('HGET', KEYS[1], 'done') == '0' then redis.call('HSET', KEYS[1], 'w', '1') end
return 1
";

/// Fenced heartbeat: the lease ends lease ms after now, and the record lives at least as long.
/// ARGV: token, lease ms. Returns the new lease end, or 0 (stale).
pub(super) const EXTEND: &str = "
local lu = now + tonumber(ARGV[2])
local nex = math.max(ex, lu)
redis.call('HSET', KEYS[1], 'lu', ms(lu), 'ex', ms(nex))
redis.call('PEXPIREAT', KEYS[1], ms(nex))
usage_renewed(lu, nex)
return lu
";

/// The fields `get` and `delete` report, in this order.
pub(super) const FIELDS: &str =
    "'fp', 'tok', 'done', 'lu', 'st', 'hd', 'bd', 'ov', 'ca', 'co', 'ex'";

/// Reads a live record: its fields, or nil when absent or past its ttl.
pub(super) fn get_script() -> String {
    format!(
        "{NOW}
local r = redis.call('HMGET', KEYS[1], {FIELDS})
if not r[1] or (tonumber(r[11]) or 0) <= now then return false end
return r"
    )
}

/// Deletes a record that is done, past its ttl, or in progress with ARGV[1] = '1' (force), in
/// one step with the check. Returns nil (absent) or `{deleted 1|0, fields…}`.
pub(super) fn delete_script() -> String {
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
pub(super) struct Scripts {
    pub(super) claim: redis::Script,
    pub(super) take_over: redis::Script,
    pub(super) complete: redis::Script,
    pub(super) confirm: redis::Script,
    /// The sources of the four above, sent whole (`EVAL`) in a pipeline with their `WAIT`.
    pub(super) claim_src: String,
    pub(super) take_over_src: String,
    pub(super) complete_src: String,
    pub(super) confirm_src: String,
    pub(super) release: redis::Script,
    pub(super) extend: redis::Script,
    pub(super) get: redis::Script,
    pub(super) delete: redis::Script,
    pub(super) mark: redis::Script,
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
            mark: redis::Script::new(MARK),
        }
    }
}

pub(super) fn scripts() -> &'static Scripts {
    static SCRIPTS: std::sync::OnceLock<Scripts> = std::sync::OnceLock::new();
    SCRIPTS.get_or_init(Scripts::new)
}
