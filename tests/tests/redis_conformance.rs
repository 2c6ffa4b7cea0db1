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

/// One caller's keys spread over every primary of the cluster (the hash tag is the scope and
/// the key, not the scope alone), and each record is one key on one node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(redis_cluster),
    ignore = "set REDIS_CLUSTER_URL=redis+cluster://host:port,… to run the Redis Cluster tests"
)]
async fn one_callers_keys_spread_over_every_primary() {
    use idempotent_core::Store;
    use idempotent_core::store::{ClaimOutcome, ClaimRequest};
    use idempotent_tests::Fixture;
    use idempotent_tests::conformance::{fp, unique_key};
    use idempotent_tests::fixtures::{redis_keys, redis_primaries};

    let fixture = Redis::cluster();
    let store = fixture.store().await;
    let scope = unique_key("x").scope;
    let n = 300;
    for i in 0..n {
        let key = idempotent_core::store::RecordKey::new(
            scope.clone(),
            idempotent_core::IdempotencyKey::parse(format!("k{i}").as_bytes()).unwrap(),
        );
        let outcome = store
            .claim(ClaimRequest {
                key: &key,
                fingerprint: &fp("a"),
                lease: std::time::Duration::from_secs(60),
                ttl: std::time::Duration::from_secs(60),
            })
            .await
            .unwrap();
        assert!(matches!(outcome, ClaimOutcome::Claimed(_)), "{outcome:?}");
    }
    let prefix = store.prefix().to_owned();
    let primaries = redis_primaries(fixture.url()).await;
    assert_eq!(primaries.len(), 3, "{primaries:?}");
    let mut total = 0;
    for node in &primaries {
        let held = redis_keys(node, &prefix).await.len();
        println!("{node}: {held} of {n} records");
        assert!(held >= n / 6, "{node} holds only {held} of {n} records");
        total += held;
    }
    assert_eq!(total, n, "every record is one key on one primary");
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
            })
            .await;
        assert!(
            matches!(claimed, Err(StoreError::Corrupt(_))),
            "{claimed:?}"
        );
    }
    fixture.cleanup().await;
}
