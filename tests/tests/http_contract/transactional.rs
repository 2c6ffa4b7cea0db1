//! Transactional routes (`/tx/sqlite`, `/tx/postgres`, `/tx/mysql`): on a store of their
//! database a stored response commits the handler's row with the record, a 5xx rolls it back and
//! a stored 4xx commits it; on another database (or the memory store) the route answers 500
//! naming nothing; a connection killed mid-transaction answers 503 with nothing half-written.

use crate::{Fw, Server, config, key, problem, serve};
use idempotent_core::MemoryStore;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Transactional routes on a store of their database: a stored response commits the row with
/// the record (then replays, nothing runs); a 5xx rolls it back and the retry runs again; a
/// 4xx is stored and commits its row. `rows` counts the business table outside any
/// transaction.
async fn tx_cycle<F, Fut>(s: &Server, path: &str, rows: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = i64>,
{
    let (runs, before) = (s.runs(), rows().await);
    let k = key();
    let first = s
        .post(path, "", Some(&k), r#"{"status": 201}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), 201);
    assert_eq!(first.headers()["idempotent-replayed"], "false");
    assert_eq!(rows().await, before + 1);
    let again = s
        .post(path, "", Some(&k), r#"{"status": 201}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(again.status(), 201);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!((s.runs() - runs, rows().await), (1, before + 1));
    let k = key();
    for n in 1..=2 {
        let failed = s
            .post(path, "", Some(&k), r#"{"status": 502}"#)
            .send()
            .await
            .unwrap();
        assert_eq!(failed.status(), 502, "the handler's own answer");
        assert!(!failed.headers().contains_key("idempotent-replayed"));
        assert_eq!(s.runs() - runs, 1 + n, "a 5xx releases: the retry runs");
        assert_eq!(rows().await, before + 1, "and its row rolled back");
    }
    let k = key();
    let refused = s
        .post(path, "", Some(&k), r#"{"status": 422}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 422);
    assert_eq!(rows().await, before + 2, "a stored 4xx commits its writes");
    let replay = s
        .post(path, "", Some(&k), r#"{"status": 422}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
}

/// A transactional route whose store is on another database (or the memory store) answers
/// 500 and never runs. The problem names no database product (the server's log does): the
/// client learns nothing of the server's wiring.
pub(crate) async fn refuses_the_wrong_database(s: &Server, path: &str, wanted: &str) {
    let runs = s.runs();
    let res = s
        .post(path, "", Some(&key()), r#"{"status": 201}"#)
        .send()
        .await
        .unwrap();
    let body = problem(res, 500, "idempotency-misconfigured").await;
    let text = body.to_string().to_ascii_lowercase();
    for product in [
        wanted, "postgres", "sqlite", "mysql", "mariadb", "memory", "redis", "database",
    ] {
        assert!(
            !text.contains(&product.to_ascii_lowercase()),
            "the problem names {product}: {body}"
        );
    }
    assert_eq!(s.runs(), runs);
}

pub(crate) async fn transactional_routes_on_memory_and_sqlite(fw: Fw) {
    let s = serve(fw, config(MemoryStore::new())).await;
    refuses_the_wrong_database(&s, "/tx/postgres", "PostgreSQL").await;
    refuses_the_wrong_database(&s, "/tx/sqlite", "SQLite").await;
    refuses_the_wrong_database(&s, "/tx/mysql", "MySQL").await;
    let dir = tempfile::tempdir().unwrap();
    let store = idempotent_core::SqliteStore::connect(&format!(
        "sqlite://{}",
        dir.path().join("tx.db").display()
    ))
    .await
    .unwrap();
    store.migrate().await.unwrap();
    sqlx::raw_sql("CREATE TABLE tx_business (id TEXT PRIMARY KEY)")
        .execute(store.pool())
        .await
        .unwrap();
    let pool = store.pool().clone();
    let s = serve(fw, config(store)).await;
    "tx_business".clone_into(&mut s.app.tx.table.lock().unwrap());
    tx_cycle(&s, "/tx/sqlite", || async {
        sqlx::query_scalar("SELECT count(*) FROM tx_business")
            .fetch_one(&pool)
            .await
            .unwrap()
    })
    .await;
    refuses_the_wrong_database(&s, "/tx/postgres", "PostgreSQL").await;
}

/// On PostgreSQL, plus the fault: the handler's connection is terminated while it holds its
/// transaction (`pg_terminate_backend`): the client gets a 503 problem with `Retry-After`,
/// nothing is half-written, and the retry runs once.
pub(crate) async fn transactional_routes_on_postgres(fw: Fw) {
    let pool = idempotent_tests::fixtures::pg_pool(16).await;
    let table = idempotent_tests::fixtures::unique_table("e2etx");
    let store = idempotent_tests::fixtures::pg_store(pool.clone(), &table).await;
    let business = format!("idempotent_test.{table}_biz");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {business} (id text PRIMARY KEY)"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let s = serve(fw, config(store)).await;
    s.app.tx.table.lock().unwrap().clone_from(&business);
    let count = format!("SELECT count(*) FROM {business}");
    let rows = || async {
        sqlx::query_scalar(sqlx::AssertSqlSafe(count.clone()))
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    tx_cycle(&s, "/tx/postgres", rows).await;
    refuses_the_wrong_database(&s, "/tx/sqlite", "SQLite").await;
    refuses_the_wrong_database(&s, "/tx/mysql", "MySQL").await;

    *s.app.tx.pid.lock().unwrap() = None;
    let id = || s.app.tx.pid.lock().unwrap().map(i64::from);
    let admin = pool.clone();
    killed_mid_transaction(&s, "/tx/postgres", rows, id, |pid| async move {
        let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1::int4)")
            .bind(pid)
            .fetch_one(&admin)
            .await
            .unwrap();
        assert!(killed);
    })
    .await;
    idempotent_tests::fixtures::pg_drop(&pool, &table).await;
    let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP TABLE {business}")))
        .execute(&pool)
        .await;
}

/// On MySQL (MariaDB): the cycle, and the fault: the handler's connection is killed (`KILL`)
/// while it holds its transaction (and the key's named lock): 503 with `Retry-After`,
/// nothing half-written, and the retry runs once (the server released the lock with the
/// session).
pub(crate) async fn transactional_routes_on_mysql(fw: Fw) {
    let pool = idempotent_tests::fixtures::mysql_pool(16).await;
    let table = idempotent_tests::fixtures::unique_table("e2etx");
    let store = idempotent_tests::fixtures::mysql_store(pool.clone(), &table).await;
    let business = format!("{table}_biz");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {business} (id VARCHAR(64) PRIMARY KEY) ENGINE = InnoDB"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let s = serve(fw, config(store)).await;
    s.app.tx.table.lock().unwrap().clone_from(&business);
    let count = format!("SELECT count(*) FROM {business}");
    let rows = || async {
        sqlx::query_scalar(sqlx::AssertSqlSafe(count.clone()))
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    tx_cycle(&s, "/tx/mysql", rows).await;
    refuses_the_wrong_database(&s, "/tx/sqlite", "SQLite").await;
    refuses_the_wrong_database(&s, "/tx/postgres", "PostgreSQL").await;

    *s.app.tx.mysql_id.lock().unwrap() = None;
    let id = || *s.app.tx.mysql_id.lock().unwrap();
    let admin = pool.clone();
    killed_mid_transaction(&s, "/tx/mysql", rows, id, |id| async move {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("KILL {id}")))
            .execute(&admin)
            .await
            .unwrap();
    })
    .await;
    idempotent_tests::fixtures::mysql_drop(&pool, &table).await;
    let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP TABLE {business}")))
        .execute(&pool)
        .await;
}

/// The fault on a transactional route: the handler's connection is ended (`kill`, given the
/// session id `id` recorded after the handler's INSERT) while it holds its transaction: 503
/// with `Retry-After`, nothing half-written (`rows`), and the retry runs once.
async fn killed_mid_transaction<R, RFut, I, K, KFut>(
    s: &Server,
    path: &str,
    rows: R,
    id: I,
    kill: K,
) where
    R: Fn() -> RFut,
    RFut: std::future::Future<Output = i64>,
    I: Fn() -> Option<i64>,
    K: FnOnce(i64) -> KFut,
    KFut: std::future::Future<Output = ()>,
{
    let (runs, before) = (s.runs(), rows().await);
    s.app.tx.hold_ms.store(1_000, Ordering::SeqCst);
    let k = key();
    let pending = tokio::spawn(s.post(path, "", Some(&k), r#"{"status": 201}"#).send());
    // Recorded after the handler's INSERT, while it holds its transaction.
    let mut recorded = None;
    for _ in 0..1_000 {
        recorded = id();
        if recorded.is_some() || pending.is_finished() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    kill(recorded.expect("the handler reached its hold")).await;
    let res = pending.await.unwrap().unwrap();
    assert_eq!(res.headers()["retry-after"], "1");
    problem(res, 503, "idempotency-store-unavailable").await;
    assert_eq!(rows().await, before, "nothing half-written");
    s.app.tx.hold_ms.store(0, Ordering::SeqCst);
    let retry = s
        .until_not_busy(|| s.post(path, "", Some(&k), r#"{"status": 201}"#))
        .await;
    assert_eq!(retry.status(), 201);
    assert_eq!(retry.headers()["idempotent-replayed"], "false");
    assert_eq!((s.runs() - runs, rows().await), (2, before + 1));
}
