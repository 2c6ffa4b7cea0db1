//! The store conformance suite on Redis: a standalone server (`REDIS_URL`) and a Redis Cluster
//! (`REDIS_CLUSTER_URL`). Without them, every test here is reported as ignored with the reason.
#![allow(clippy::unwrap_used)] // tests unwrap freely

use idempotent_tests::conformance_suite;
use idempotent_tests::fixtures::Redis;

conformance_suite!(
    standalone,
    Redis::standalone(),
    #[cfg_attr(
        not(redis_standalone),
        ignore = "set REDIS_URL=redis://… to run the Redis tests"
    )]
);

conformance_suite!(
    cluster,
    Redis::cluster(),
    #[cfg_attr(
        not(redis_cluster),
        ignore = "set REDIS_CLUSTER_URL=redis+cluster://host:port,… to run the Redis Cluster tests"
    )]
);

/// Callers' keys spread over every primary of the cluster (a caller's hash tag is its scope),
/// and each record is one key on one node; one caller's records, and its usage, share one
/// slot, so the script that charges a claim to its caller's bounds is atomic (issue 49: a
/// caller's keys used to spread too, the hash tag being the scope and the key, and no bound
/// per caller could be kept in one script).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(redis_cluster),
    ignore = "set REDIS_CLUSTER_URL=redis+cluster://host:port,… to run the Redis Cluster tests"
)]
async fn callers_spread_over_every_primary_and_a_caller_is_one_slot() {
    use idempotent_core::Store;
    use idempotent_core::store::{ClaimOutcome, ClaimRequest, RecordKey};
    use idempotent_tests::Fixture;
    use idempotent_tests::conformance::{fp, unique_key};
    use idempotent_tests::fixtures::{redis_keys, redis_node, redis_primaries};

    let fixture = Redis::cluster();
    let store = fixture.store().await;
    let n = 300;
    let claim = |key: RecordKey| {
        let store = store.clone();
        async move {
            let outcome = store
                .claim(ClaimRequest {
                    key: &key,
                    fingerprint: &fp("a"),
                    lease: std::time::Duration::from_secs(60),
                    ttl: std::time::Duration::from_secs(60),
                    max_stored: 0,
                })
                .await
                .unwrap();
            assert!(matches!(outcome, ClaimOutcome::Claimed(_)), "{outcome:?}");
        }
    };
    // 300 callers, a key each.
    for i in 0..n {
        claim(unique_key(&format!("c{i}"))).await;
    }
    let prefix = store.prefix().to_owned();
    let primaries = redis_primaries(fixture.url()).await;
    assert_eq!(primaries.len(), 3, "{primaries:?}");
    let records = |keys: Vec<Vec<u8>>| {
        keys.into_iter()
            .filter(|k| k.windows(2).any(|w| w == b"}:"))
            .count()
    };
    let mut total = 0;
    for node in &primaries {
        let held = records(redis_keys(node, &prefix).await);
        println!("{node}: {held} of {n} callers' records");
        assert!(held >= n / 6, "{node} holds only {held} of {n} records");
        total += held;
    }
    assert_eq!(total, n, "every record is one key on one primary");
    // One caller's 50 keys: one slot, that of its usage too.
    let scope = unique_key("one").scope;
    let keys: Vec<RecordKey> = (0..50)
        .map(|i| {
            RecordKey::new(
                scope.clone(),
                idempotent_core::IdempotencyKey::parse(format!("k{i}").as_bytes()).unwrap(),
            )
        })
        .collect();
    for key in &keys {
        claim(key.clone()).await;
    }
    let mut conn = redis_node(&primaries[0]).await;
    let mut slots = std::collections::BTreeSet::new();
    for key in &keys {
        let slot: i64 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(store.redis_key(key))
            .query_async(&mut conn)
            .await
            .unwrap();
        slots.insert(slot);
    }
    assert_eq!(slots.len(), 1, "one caller's records span slots: {slots:?}");
    fixture.cleanup().await;
}

/// The ttl of a record in Redis itself: `PTTL` on whichever primary holds it (-2: no key).
async fn pttl(url: &str, key: &[u8]) -> i64 {
    let mut found = -2;
    for node in idempotent_tests::fixtures::redis_primaries(url).await {
        let mut conn = idempotent_tests::fixtures::redis_node(&node).await;
        let ttl: redis::RedisResult<i64> = redis::cmd("PTTL").arg(key).query_async(&mut conn).await;
        match ttl {
            Ok(ttl) => found = found.max(ttl),
            // Another primary's slot.
            Err(e) if e.code() == Some("MOVED") => {}
            Err(e) => panic!("PTTL on {node}: {e}"),
        }
    }
    found
}

/// Redis deletes a record itself when its ttl passes (`PEXPIREAT`): the key carries the
/// record's expiry (lease + ttl after the claim), and after it the key is gone from Redis, not
/// only hidden by the store's reads.
async fn records_expire_in_redis_itself(fixture: Redis) {
    use idempotent_core::Store;
    use idempotent_core::store::{ClaimOutcome, ClaimRequest, StoredResponse};
    use idempotent_tests::Fixture;
    use idempotent_tests::conformance::{fp, unique_key};
    use std::time::Duration;

    let store = fixture.store().await;
    let key = unique_key("expiring");
    let (lease, ttl) = (Duration::from_millis(300), Duration::from_millis(700));
    let ClaimOutcome::Claimed(claimed) = store
        .claim(ClaimRequest {
            key: &key,
            fingerprint: &fp("a"),
            lease,
            ttl,
            max_stored: 0,
        })
        .await
        .unwrap()
    else {
        panic!("not claimed");
    };
    let rkey = store.redis_key(&key);
    let at_claim = pttl(fixture.url(), &rkey).await;
    assert!(
        (1..=1000).contains(&at_claim),
        "PTTL after the claim: {at_claim}"
    );
    store
        .complete(
            &key,
            claimed.token,
            &StoredResponse::new(201, "x").into(),
            ttl,
        )
        .await
        .unwrap();
    let at_complete = pttl(fixture.url(), &rkey).await;
    assert!(
        (1..=1000).contains(&at_complete),
        "PTTL after the complete: {at_complete}"
    );
    tokio::time::sleep(Duration::from_millis(1300)).await;
    assert_eq!(
        pttl(fixture.url(), &rkey).await,
        -2,
        "the key outlived its ttl"
    );
    fixture.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(redis_standalone),
    ignore = "set REDIS_URL=redis://… to run the Redis tests"
)]
async fn standalone_records_expire_in_redis_itself() {
    records_expire_in_redis_itself(Redis::standalone()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(redis_cluster),
    ignore = "set REDIS_CLUSTER_URL=redis+cluster://host:port,… to run the Redis Cluster tests"
)]
async fn cluster_records_expire_in_redis_itself() {
    records_expire_in_redis_itself(Redis::cluster()).await;
}

/// `wait_for_replicas` on the cluster (a replica per primary): claims and completions go
/// through with their `WAIT`s; a completion repeated by the token that made it (the engine's
/// retry after a short `WAIT` or a lost answer) is done, another token's is refused; replays
/// and in-progress answers are as without the wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(redis_cluster),
    ignore = "set REDIS_CLUSTER_URL=redis+cluster://host:port,… to run the Redis Cluster tests"
)]
async fn cluster_with_wait_for_replicas() {
    use idempotent_core::store::{ClaimOutcome, ClaimRequest, LeaseToken, StoredResponse};
    use idempotent_core::{Store, StoreError};
    use idempotent_tests::Fixture;
    use idempotent_tests::conformance::{fp, unique_key};
    use std::time::Duration;

    let fixture = Redis::cluster();
    let prefix = format!("{}:", idempotent_tests::fixtures::unique_table("w"));
    let store = idempotent_core::RedisStore::builder()
        .prefix(&prefix)
        .wait_for_replicas(1, Duration::from_millis(500))
        .connect(fixture.url())
        .await
        .unwrap();
    fn claim<'a>(
        key: &'a idempotent_core::store::RecordKey,
        fingerprint: &'a idempotent_core::fingerprint::Fingerprint,
    ) -> ClaimRequest<'a> {
        ClaimRequest {
            key,
            fingerprint,
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(60),
            max_stored: 0,
        }
    }
    let fingerprint = fp("a");
    for i in 0..20 {
        let key = unique_key(&format!("w{i}"));
        let ClaimOutcome::Claimed(lease) = store.claim(claim(&key, &fingerprint)).await.unwrap()
        else {
            panic!("not claimed");
        };
        assert!(matches!(
            store.claim(claim(&key, &fingerprint)).await.unwrap(),
            ClaimOutcome::InProgress { .. }
        ));
        let outcome = StoredResponse::new(201, format!("r{i}")).into();
        let ttl = Duration::from_secs(60);
        store
            .complete(&key, lease.token, &outcome, ttl)
            .await
            .unwrap();
        store
            .complete(&key, lease.token, &outcome, ttl)
            .await
            .unwrap();
        assert!(matches!(
            store
                .complete(&key, LeaseToken::generate(), &outcome, ttl)
                .await,
            Err(StoreError::StaleLease)
        ));
        assert_eq!(
            store.claim(claim(&key, &fingerprint)).await.unwrap(),
            ClaimOutcome::Replay(outcome)
        );
    }
    assert_eq!(
        store.short_waits(),
        0,
        "a healthy cluster acknowledged every write"
    );
    // A wait that cannot be met (more replicas than any primary has): refused before the
    // handler could run, and the key is free again.
    let strict = idempotent_core::RedisStore::builder()
        .prefix(&prefix)
        .wait_for_replicas(2, Duration::from_millis(200))
        .connect(fixture.url())
        .await
        .unwrap();
    let key = unique_key("strict");
    assert!(matches!(
        strict.claim(claim(&key, &fingerprint)).await,
        Err(StoreError::Unavailable(_))
    ));
    assert_eq!(strict.short_waits(), 1);
    assert_eq!(
        strict.get(&key).await.unwrap(),
        None,
        "the short claim was released"
    );
    for node in idempotent_tests::fixtures::redis_primaries(fixture.url()).await {
        let mut conn = idempotent_tests::fixtures::redis_node(&node).await;
        for k in idempotent_tests::fixtures::redis_keys(&node, &prefix).await {
            let _: i64 = redis::cmd("UNLINK")
                .arg(k)
                .query_async(&mut conn)
                .await
                .unwrap();
        }
    }
    fixture.cleanup().await;
}

/// A key of ours that holds something else (another program wrote it) is a corrupt record,
/// never "unavailable" (which a fail-open route would run unprotected on): with and without a
/// wait, whose pipeline reports the script's error without its code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(redis_standalone),
    ignore = "set REDIS_URL=redis://… to run the Redis tests"
)]
async fn a_key_holding_something_else_is_corrupt() {
    use idempotent_core::store::ClaimRequest;
    use idempotent_core::{Store, StoreError};
    use idempotent_tests::Fixture;
    use idempotent_tests::conformance::{fp, unique_key};
    use std::time::Duration;

    let fixture = Redis::standalone();
    let plain = fixture.store().await;
    let waiting = idempotent_core::RedisStore::builder()
        .prefix(plain.prefix())
        .wait_for_replicas(1, Duration::from_millis(100))
        .connect(fixture.url())
        .await
        .unwrap();
    let key = unique_key("wrongtype");
    let mut conn = idempotent_tests::fixtures::redis_node(fixture.url()).await;
    let _: () = redis::cmd("SET")
        .arg(plain.redis_key(&key))
        .arg("not a record")
        .query_async(&mut conn)
        .await
        .unwrap();
    let fingerprint = fp("a");
    for store in [&plain, &waiting] {
        let claimed = store
            .claim(ClaimRequest {
                key: &key,
                fingerprint: &fingerprint,
                lease: Duration::from_secs(5),
                ttl: Duration::from_secs(5),
                max_stored: 0,
            })
            .await;
        assert!(
            matches!(claimed, Err(StoreError::Corrupt(_))),
            "{claimed:?}"
        );
    }
    fixture.cleanup().await;
}

/// A standalone store on `prefix` through a proxy on 127.0.0.1 (whose connections the test can
/// freeze), with `response_timeout`.
async fn through_proxy(
    fixture: &Redis,
    prefix: &str,
    response_timeout: std::time::Duration,
) -> (
    idempotent_tests::stall::StallingProxy,
    idempotent_core::RedisStore,
) {
    let upstream = fixture
        .url()
        .strip_prefix("redis://")
        .and_then(|rest| rest.split('/').next())
        .and_then(|addr| addr.parse().ok())
        .expect("REDIS_URL must be redis://<ip>:<port>[/db] for the proxy tests");
    let proxy = idempotent_tests::stall::StallingProxy::start(upstream).await;
    let path = fixture
        .url()
        .strip_prefix("redis://")
        .and_then(|rest| rest.split_once('/'))
        .map_or(String::new(), |(_, db)| format!("/{db}"));
    let store = idempotent_core::RedisStore::builder()
        .prefix(prefix)
        .response_timeout(response_timeout)
        .connect(&format!("redis://{}{path}", proxy.addr()))
        .await
        .unwrap();
    (proxy, store)
}

/// A connection that stays open but stops answering (a network that drops packets, a
/// half-open connection nobody resets) is replaced: the command that got no answer fails,
/// and the ones after it go through a new connection. The `redis` crate's
/// `ConnectionManager` reconnects only when its connection closes, so without the rebuild
/// every command would time out until the operating system gave up on the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(redis_standalone),
    ignore = "set REDIS_URL=redis://… to run the Redis tests"
)]
async fn a_connection_that_stops_answering_is_replaced() {
    use idempotent_core::{Store, StoreError};
    use idempotent_tests::conformance::unique_key;
    use std::time::{Duration, Instant};

    let fixture = Redis::standalone();
    let direct = fixture.store().await;
    let (proxy, store) = through_proxy(&fixture, direct.prefix(), Duration::from_millis(300)).await;
    let key = unique_key("frozen");
    assert_eq!(store.get(&key).await.unwrap(), None);
    proxy.freeze_open();
    let first = store.get(&key).await;
    assert!(
        matches!(first, Err(StoreError::Unavailable(_))),
        "a frozen connection answered: {first:?}"
    );
    assert_eq!(proxy.stalled(), 1, "the command was held by the proxy");
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut failures = 1;
    loop {
        match store.get(&key).await {
            Ok(None) => break,
            Ok(other) => panic!("{other:?}"),
            Err(e) => {
                failures += 1;
                assert!(
                    Instant::now() < deadline,
                    "still failing 5 s after the connection froze ({failures} failures): {e}"
                );
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(proxy.stalled(), 1, "the new connection was not frozen");
}

/// Stop 45's CI failure, on a standalone server: the connection of an execution stops
/// answering when its outcome is to be stored (here right after its claim), and its lease
/// (2 s) is shorter than the store's response timeout (5 s, the default). Its completion
/// hangs for the whole timeout; its renewals give up after an eighth of the lease and go
/// through a new connection, so a duplicate sent to another instance finds the record in
/// progress throughout (before, it took the lease over after 2 s, and would have run the
/// handler again), and the completion, retried on the new connection, is stored and
/// replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(redis_standalone),
    ignore = "set REDIS_URL=redis://… to run the Redis tests"
)]
async fn a_lease_outlives_a_connection_that_stops_answering() {
    use idempotent_core::engine::{Begin, Engine, ExecuteRequest, Policy, Recorded};
    use idempotent_core::store::{StoredOutcome, StoredResponse};
    use idempotent_core::{IdempotencyKey, Scope};
    use std::time::{Duration, Instant};

    let fixture = Redis::standalone();
    let direct = fixture.store().await;
    let (proxy, proxied) = through_proxy(&fixture, direct.prefix(), Duration::from_secs(5)).await;
    let holder = Engine::new(proxied);
    let other = Engine::new(direct);
    let policy = Policy {
        lease: Duration::from_secs(2),
        ..Policy::default()
    };
    let scope = format!("acct_{}", idempotent_core::uuid::Uuid::new_v4());
    let request = || ExecuteRequest {
        scope: Scope::new(scope.clone()).unwrap(),
        key: IdempotencyKey::parse(b"charge-1"),
        fingerprint: idempotent_tests::conformance::fp("charge-1"),
    };
    let Begin::Claimed(execution) = holder.begin(request(), &policy).await else {
        panic!("not claimed")
    };
    proxy.freeze_open();
    let frozen = Instant::now();
    let finishing = tokio::spawn(execution.finish(StoredResponse::new(201, "once").into()));
    while !finishing.is_finished() {
        tokio::time::sleep(Duration::from_millis(200)).await;
        match other.begin(request(), &policy).await {
            Begin::InProgress { .. } => {}
            // The completion landed; `finishing` is about to end.
            Begin::Replay(_) => break,
            found => panic!(
                "a duplicate {} ms after the connection froze found {found:?}: the lease ran out",
                frozen.elapsed().as_millis()
            ),
        }
    }
    let recorded = finishing.await.unwrap();
    assert!(matches!(recorded, Recorded::Stored), "{recorded:?}");
    assert!(
        frozen.elapsed() >= Duration::from_secs(5),
        "the completion did not wait out the response timeout: the connection was not frozen"
    );
    let replay = other.begin(request(), &policy).await;
    assert!(
        matches!(&replay, Begin::Replay(StoredOutcome::Response(r)) if r.status == 201 && r.body == b"once"),
        "{replay:?}"
    );
}

/// A Redis server of the test's own on a free port of 127.0.0.1, with `maxmemory` and
/// `noeviction` (the store's required policy), no persistence; killed when dropped. The
/// shared server's settings are never changed.
struct SmallRedis {
    child: std::process::Child,
    url: String,
    _dir: tempfile::TempDir,
}

impl SmallRedis {
    async fn start(maxmemory: &str) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let dir = tempfile::tempdir().unwrap();
        let child = std::process::Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--maxmemory", maxmemory, "--maxmemory-policy", "noeviction"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(dir.path())
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("redis-server (the tests start one of their own)");
        let url = format!("redis://127.0.0.1:{port}");
        let started = std::time::Instant::now();
        loop {
            if let Ok(client) = redis::Client::open(url.as_str())
                && let Ok(mut conn) = client.get_multiplexed_async_connection().await
                && redis::cmd("PING")
                    .query_async::<String>(&mut conn)
                    .await
                    .is_ok()
            {
                break;
            }
            assert!(
                started.elapsed().as_secs() < 10,
                "redis-server did not start"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        SmallRedis {
            child,
            url,
            _dir: dir,
        }
    }
}

impl Drop for SmallRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Issue 49 (5): one caller's concurrent requests cannot fill Redis for everyone. On a server
/// of 24 MiB (`noeviction`), 60 concurrent 512 KiB requests of one caller under its 4 MiB
/// bound: the claims past the bound are refused at once (`ScopeByteCapacity`, 503), every
/// admitted one stores its response, and another caller's requests still claim and store.
/// Before, every claim was admitted, their responses filled `maxmemory`, completes in flight
/// failed (`OOM`, so those handlers would run again) and every caller's claims were refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(redis_standalone),
    ignore = "set REDIS_URL=redis://… to run the Redis tests"
)]
async fn one_caller_cannot_fill_redis_for_everyone() {
    use idempotent_core::store::{ClaimOutcome, ClaimRequest, RecordKey, StoredResponse};
    use idempotent_core::{Scope, Store, StoreError};
    use idempotent_tests::conformance::fp;
    use std::time::Duration;

    const KIB: u64 = 1024;
    let server = SmallRedis::start("24mb").await;
    let store = idempotent_core::RedisStore::builder()
        .max_bytes_per_scope(4 * 1024 * KIB)
        .connect(&server.url)
        .await
        .unwrap();
    // Claims, then completes with 512 KiB, `n` keys of `scope` at once.
    let run = |scope: &'static str, n: usize| {
        let store = store.clone();
        async move {
            let tasks: Vec<_> = (0..n)
                .map(|i| {
                    let store = store.clone();
                    tokio::spawn(async move {
                        let key = RecordKey::new(
                            Scope::new(scope).unwrap(),
                            format!("k{i}").parse().unwrap(),
                        );
                        let long = Duration::from_secs(60);
                        let claimed = store
                            .claim(ClaimRequest {
                                key: &key,
                                fingerprint: &fp("a"),
                                lease: long,
                                ttl: long,
                                max_stored: 512 * KIB,
                            })
                            .await;
                        match claimed {
                            Ok(ClaimOutcome::Claimed(lease)) => {
                                let body = vec![b'x'; 512 * 1024];
                                let stored = StoredResponse::new(201, body).into();
                                Some(store.complete(&key, lease.token, &stored, long).await)
                            }
                            Err(StoreError::ScopeByteCapacity { .. }) => None,
                            other => panic!("{scope}: {other:?}"),
                        }
                    })
                })
                .collect();
            let mut completes = Vec::new();
            for t in tasks {
                completes.extend(t.await.unwrap());
            }
            completes
        }
    };
    let greedy = run("greedy", 60).await;
    assert!(
        (4..=8).contains(&greedy.len()),
        "{} of the caller's claims admitted under a 4 MiB bound",
        greedy.len()
    );
    for complete in &greedy {
        assert!(
            complete.is_ok(),
            "an admitted claim's complete failed: {complete:?}"
        );
    }
    let other = run("other", 5).await;
    assert_eq!(other.len(), 5, "another caller's claims were refused");
    for complete in &other {
        assert!(
            complete.is_ok(),
            "another caller's complete failed: {complete:?}"
        );
    }
}

/// A caller's record bound, and what gives its room back: a release at once, expiry in
/// Redis (swept out of its usage by the next claims). The unscoped namespace has no bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(redis_standalone),
    ignore = "set REDIS_URL=redis://… to run the Redis tests"
)]
async fn a_callers_record_bound_gives_room_back_on_release_and_expiry() {
    use idempotent_core::store::{ClaimOutcome, ClaimRequest, RecordKey};
    use idempotent_core::{IdempotencyKey, Scope, Store, StoreError};
    use idempotent_tests::conformance::fp;
    use std::time::Duration;

    let server = SmallRedis::start("32mb").await;
    let store = idempotent_core::RedisStore::builder()
        .max_per_scope(3)
        .connect(&server.url)
        .await
        .unwrap();
    let (lease, ttl) = (Duration::from_millis(300), Duration::from_millis(300));
    let claim = |scope: Scope, k: &str| {
        let (store, k) = (store.clone(), k.to_owned());
        async move {
            let key = RecordKey::new(scope, IdempotencyKey::parse(k.as_bytes()).unwrap());
            store
                .claim(ClaimRequest {
                    key: &key,
                    fingerprint: &fp("a"),
                    lease,
                    ttl,
                    max_stored: 0,
                })
                .await
        }
    };
    let caller = || Scope::new("caller").unwrap();
    let mut held = Vec::new();
    for k in ["k0", "k1", "k2"] {
        let Ok(ClaimOutcome::Claimed(lease)) = claim(caller(), k).await else {
            panic!("{k} not claimed");
        };
        held.push(lease);
    }
    assert!(matches!(
        claim(caller(), "k3").await,
        Err(StoreError::ScopeCapacity { max_per_scope: 3 })
    ));
    // The unscoped namespace is not bounded per scope.
    for i in 0..5 {
        assert!(matches!(
            claim(Scope::unscoped(), &format!("u{i}")).await,
            Ok(ClaimOutcome::Claimed(_))
        ));
    }
    // A release gives its room back at once.
    let k0 = RecordKey::new(caller(), "k0".parse().unwrap());
    store.release(&k0, held[0].token).await.unwrap();
    assert!(matches!(
        claim(caller(), "k3").await,
        Ok(ClaimOutcome::Claimed(_))
    ));
    assert!(matches!(
        claim(caller(), "k4").await,
        Err(StoreError::ScopeCapacity { .. })
    ));
    // Records Redis expired give theirs back at the next claims.
    tokio::time::sleep(lease + ttl + Duration::from_millis(300)).await;
    for k in ["k5", "k6", "k7"] {
        assert!(
            matches!(claim(caller(), k).await, Ok(ClaimOutcome::Claimed(_))),
            "{k}: expired records still counted"
        );
    }
}

/// Review of issue 49: a claim whose lease ran out (its execution crashed, or gave up on its
/// complete) gives its reservation back at the caller's next claim, so executions that died
/// do not hold their caller's bytes until their records expire (a day, by default). Their
/// records stay: a retry takes one over, reserving again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(redis_standalone),
    ignore = "set REDIS_URL=redis://… to run the Redis tests"
)]
async fn a_lapsed_lease_gives_its_reservation_back() {
    use idempotent_core::store::{ClaimOutcome, ClaimRequest, Lease, RecordKey};
    use idempotent_core::{Scope, Store, StoreError};
    use idempotent_tests::conformance::fp;
    use std::time::Duration;

    const KIB: u64 = 1024;
    let server = SmallRedis::start("32mb").await;
    let store = idempotent_core::RedisStore::builder()
        .max_bytes_per_scope(1024 * KIB)
        .connect(&server.url)
        .await
        .unwrap();
    let claim = |k: &'static str| {
        let store = store.clone();
        async move {
            let key = RecordKey::new(Scope::new("caller").unwrap(), k.parse().unwrap());
            store
                .claim(ClaimRequest {
                    key: &key,
                    fingerprint: &fp("a"),
                    lease: Duration::from_millis(300),
                    ttl: Duration::from_secs(3600),
                    max_stored: 400 * KIB,
                })
                .await
        }
    };
    for k in ["a", "b"] {
        assert!(matches!(claim(k).await, Ok(ClaimOutcome::Claimed(_))));
    }
    let out = claim("c").await;
    assert!(
        matches!(out, Err(StoreError::ScopeByteCapacity { .. })),
        "{out:?}"
    );
    tokio::time::sleep(Duration::from_millis(400)).await;
    let out = claim("c").await;
    assert!(matches!(out, Ok(ClaimOutcome::Claimed(_))), "{out:?}");
    let again = claim("a").await.unwrap();
    assert!(matches!(
        again,
        ClaimOutcome::Claimed(Lease {
            took_over: true,
            ..
        })
    ));
}
