//! The store conformance suite on MySQL / MariaDB (`MYSQL_URL`). Without it, every test here
//! is reported as ignored with the reason below.

use idempotent_tests::conformance_suite;
use idempotent_tests::fixtures::MySql;

conformance_suite!(
    mysql,
    MySql::new(),
    #[cfg_attr(not(mysql_db), ignore = "set MYSQL_URL=mysql://… to run the MySQL tests")]
);
