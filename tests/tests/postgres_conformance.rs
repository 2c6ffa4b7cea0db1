//! The store conformance suite on PostgreSQL (`DATABASE_URL`). Without it, every test here
//! is reported as ignored with the reason below.

use idempotent_tests::conformance_suite;
use idempotent_tests::fixtures::Postgres;

conformance_suite!(
    postgres,
    Postgres::new(),
    #[cfg_attr(not(pg), ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests")]
);
