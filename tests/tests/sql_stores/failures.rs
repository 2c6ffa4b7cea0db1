//! Failures and refusals: a complete that meets SQLite's held write lock, a PostgreSQL
//! connection killed mid-claim (unavailable, never a duplicate), an unreachable database, and
//! a table name that is not an identifier.

use super::*;

/// A `complete` that meets SQLite's write lock held past the busy timeout fails; the engine
/// retries it within the lease, and stores the outcome once the lock is gone. If the lock
/// outlasts the retries, the record stays in progress: a retry gets "in progress", never a
/// second execution.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_complete_waits_out_a_held_write_lock() {
    use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
    let dir = tempfile::tempdir().unwrap();
    let options = SqliteConnectOptions::new()
        .filename(dir.path().join("locked.db"))
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_millis(100));
    let pool = SqlitePoolOptions::new()
        .test_before_acquire(false)
        .connect_with(options)
        .await
        .unwrap();
    let store = SqliteStore::builder(pool.clone()).build().unwrap();
    store.migrate().await.unwrap();
    let engine = Engine::new(store.clone());
    let outcome = || StoredOutcome::from(StoredResponse::new(201, "ok"));

    for (lease_ms, hold_ms, stored) in [(4000, 600, true), (600, 2000, false)] {
        let policy = Policy {
            lease: Duration::from_millis(lease_ms),
            ..Policy::default()
        };
        let key = unique_key("locked");
        let Begin::Claimed(execution) = engine.begin(request(&key), &policy).await else {
            panic!("not claimed")
        };
        // Another writer takes the database's write lock and holds it.
        let mut blocker = pool.acquire().await.unwrap();
        sqlx::query("BEGIN IMMEDIATE")
            .execute(&mut *blocker)
            .await
            .unwrap();
        let holder = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(hold_ms)).await;
            sqlx::query("COMMIT").execute(&mut *blocker).await.unwrap();
        });
        let recorded = execution.finish(outcome()).await;
        if stored {
            assert!(matches!(recorded, Recorded::Stored), "{recorded:?}");
            assert!(matches!(
                engine.begin(request(&key), &policy).await,
                Begin::Replay(_)
            ));
        } else {
            assert!(
                matches!(recorded, Recorded::Failed(StoreError::Unavailable(_))),
                "{recorded:?}"
            );
            // Readers are not blocked in WAL mode: the retry sees the attempt in progress.
            assert!(matches!(
                engine.begin(request(&key), &policy).await,
                Begin::InProgress { .. }
            ));
        }
        holder.await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(pg),
    ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
)]
async fn postgres_killed_connection_mid_claim_is_unavailable_not_a_duplicate() {
    let table = unique_table("kill");
    let pool = pg_pool(1).await; // one connection, so we know its backend pid
    let store = pg_store(pool.clone(), &table).await;
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&pool)
        .await
        .unwrap();

    // Another session inserts the same key and holds its transaction open, so our claim's
    // INSERT … ON CONFLICT waits on the unique index: the claim is in flight.
    let key = unique_key("kill");
    let other = pg_pool(2).await;
    let mut blocker = other.begin().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO idempotent_test.{table} (scope, key, fingerprint, token, locked_until, expires_at)
         VALUES ($1, $2, $3, gen_random_uuid(), now() + interval '1 minute', now() + interval '1 hour')"
    )))
    .bind(key.scope.as_str())
    .bind(key.key.as_str())
    .bind(fp("k").to_stored().to_vec())
    .execute(&mut *blocker)
    .await
    .unwrap();
    let claim = {
        let (store, key) = (store.clone(), key.clone());
        tokio::spawn(async move {
            store
                .claim(ClaimRequest {
                    key: &key,
                    fingerprint: &fp("k"),
                    lease: Duration::from_secs(30),
                    ttl: Duration::from_secs(60),
                    max_stored: 0,
                })
                .await
        })
    };
    // Wait until the claim is waiting on the lock, then kill its backend.
    for _ in 0..100 {
        let waiting: Option<String> =
            sqlx::query_scalar("SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1")
                .bind(pid)
                .fetch_optional(&other)
                .await
                .unwrap()
                .flatten();
        if waiting.as_deref() == Some("Lock") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(&other)
        .await
        .unwrap();
    assert!(killed);
    let result = claim.await.unwrap();
    assert!(
        matches!(result, Err(StoreError::Unavailable(_))),
        "{result:?}"
    );
    blocker.rollback().await.unwrap();

    // The pool reconnects; exactly one claim now wins and nothing was left behind.
    let again = store
        .claim(ClaimRequest {
            key: &key,
            fingerprint: &fp("k"),
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(60),
            max_stored: 0,
        })
        .await
        .unwrap();
    assert!(
        matches!(
            again,
            ClaimOutcome::Claimed(Lease {
                took_over: false,
                ..
            })
        ),
        "{again:?}"
    );
    let rows: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM idempotent_test.{table}"
    )))
    .fetch_one(&other)
    .await
    .unwrap();
    assert_eq!(rows, 1);
    pg_drop(&other, &table).await;
}

#[tokio::test]
async fn unreachable_database_is_unavailable() {
    // A PostgreSQL port nothing listens on; the pool times out fast.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(300))
        .connect_lazy("postgres://postgres@127.0.0.1:1/none")
        .unwrap();
    let store = PostgresStore::new(pool).unwrap();
    let engine = Engine::new(store);
    let key = unique_key("down");
    let out = engine
        .execute(request(&key), &Policy::default(), || async { handled() })
        .await;
    assert!(
        matches!(out, Outcome::StoreUnavailable(StoreError::Unavailable(_))),
        "{out:?}"
    );
}

#[tokio::test]
async fn invalid_table_names_are_refused() {
    let store = SqliteStore::connect("sqlite::memory:").await.unwrap();
    let bad = SqliteStore::builder(store.pool().clone())
        .table("x; DROP TABLE y")
        .build();
    assert!(matches!(bad, Err(SetupError::InvalidIdentifier(_))));
}
