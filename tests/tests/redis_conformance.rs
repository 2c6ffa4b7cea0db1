//! The store conformance suite on Redis: a standalone server (`REDIS_URL`) and a Redis Cluster
//! (`REDIS_CLUSTER_URL`). Without them, every test here is reported as ignored with the reason.

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
