//! The store conformance suite on SQLite: in memory, and on a WAL database file.

use idempotent_tests::conformance_suite;
use idempotent_tests::fixtures::Sqlite;

conformance_suite!(sqlite_memory, Sqlite::memory());
conformance_suite!(sqlite_file, Sqlite::file());
