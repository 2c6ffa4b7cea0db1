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
