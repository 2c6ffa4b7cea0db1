//! Round trips, counted at the store: a first execution's statements and a replay's one read on
//! SQLite, PostgreSQL and MySQL; a replay that neither writes the row (PostgreSQL's `xmax`)
//! nor waits for its lock (MySQL); a complete that is a HOT update (PostgreSQL).

use super::*;

#[tokio::test]
async fn sqlite_round_trips() {
    let store = SqliteStore::connect("sqlite::memory:").await.unwrap();
    store.migrate().await.unwrap();
    let engine = unswept(store.clone());
    // SQLite: read (miss) + INSERT … RETURNING + complete; replays are the read alone.
    round_trips(&engine, || store.statements_sent(), 3).await;
}

#[tokio::test]
#[cfg_attr(
    not(pg),
    ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
)]
async fn postgres_round_trips_and_no_write_on_replay() {
    let _ = PG_ONLY;
    let pool = pg_pool(4).await;
    let table = unique_table("rt");
    let store = pg_store(pool.clone(), &table).await;
    let engine = unswept(store.clone());
    round_trips(&engine, || store.statements_sent(), 2).await;

    // A replay must not lock or rewrite the row: `ON CONFLICT DO UPDATE … WHERE false` would
    // stamp the row's xmax with the replaying transaction; our statement leaves it at 0.
    let key = unique_key("xmax");
    engine
        .execute(request(&key), &Policy::default(), || async { handled() })
        .await;
    let (xmin_before, _) = row_versions(&pool, &table, &key).await;
    for _ in 0..5 {
        let out = engine
            .execute(request(&key), &Policy::default(), || async { handled() })
            .await;
        assert!(matches!(out, Outcome::Replayed(_)));
    }
    let (xmin, xmax) = row_versions(&pool, &table, &key).await;
    assert_eq!(
        (xmin, xmax.as_str()),
        (xmin_before, "0"),
        "replays wrote to the row"
    );
    pg_drop(&pool, &table).await;
}

/// The row's `xmin` and `xmax` (which transactions wrote and locked it).
async fn row_versions(pool: &sqlx::PgPool, table: &str, key: &RecordKey) -> (String, String) {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT xmin::text, xmax::text FROM idempotent_test.{table} WHERE scope = $1 AND key = $2"
    )))
    .bind(key.scope.as_str())
    .bind(key.key.as_str())
    .fetch_one(pool)
    .await
    .unwrap()
}

#[tokio::test]
#[cfg_attr(
    not(pg),
    ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
)]
async fn postgres_complete_is_a_hot_update() {
    // One connection, so the statistics we flush are the ones our statements produced.
    let pool = pg_pool(1).await;
    let table = unique_table("hot");
    let store = pg_store(pool.clone(), &table).await;
    let engine = unswept(store);
    for _ in 0..50 {
        let key = unique_key("hot");
        let out = engine
            .execute(request(&key), &Policy::default(), || async { handled() })
            .await;
        assert!(matches!(
            out,
            Outcome::Executed {
                recorded: Recorded::Stored,
                ..
            }
        ));
    }
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(&pool)
        .await
        .unwrap();
    let mut counts = (0_i64, 0_i64);
    for _ in 0..50 {
        counts = sqlx::query_as(
            "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE schemaname = 'idempotent_test' AND relname = $1",
        )
        .bind(&table)
        .fetch_one(&pool)
        .await
        .unwrap();
        if counts.0 >= 50 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (updates, hot) = counts;
    assert_eq!(updates, 50, "one complete per execution");
    assert!(
        hot >= 45,
        "completes should be HOT updates: {hot} of {updates}"
    );
    pg_drop(&pool, &table).await;
}

/// Plain mode: a first execution is three statements (the read that misses, the `INSERT`
/// that claims, the `UPDATE` that completes) and a replay one; a replay takes no lock: it
/// answers while another transaction holds the record's row locked (a locking read or a
/// write would wait for it).
#[tokio::test]
#[cfg_attr(
    not(mysql_db),
    ignore = "set MYSQL_URL=mysql://… to run the MySQL tests"
)]
async fn mysql_round_trips_and_no_lock_on_replay() {
    let pool = mysql_pool(4).await;
    let table = unique_table("rt");
    let store = mysql_store(pool.clone(), &table).await;
    let engine = unswept(store.clone());
    warm_up(&engine).await;
    round_trips(&engine, || store.statements_sent(), 3).await;

    let key = unique_key("locked");
    engine
        .execute(request(&key), &Policy::default(), || async { handled() })
        .await;
    let mut locker = pool.begin().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT 1 FROM {table} WHERE scope = ? AND `key` = ? FOR UPDATE"
    )))
    .bind(key.scope.as_str())
    .bind(key.key.as_str())
    .fetch_one(&mut *locker)
    .await
    .unwrap();
    for _ in 0..3 {
        let out = tokio::time::timeout(
            Duration::from_secs(5),
            engine.execute(request(&key), &Policy::default(), || async { handled() }),
        )
        .await
        .expect("a replay waited for the row's lock");
        assert!(matches!(out, Outcome::Replayed(_)), "{out:?}");
    }
    locker.rollback().await.unwrap();
    mysql_drop(&pool, &table).await;
}
