//! SQL store latency next to the physical floor measured in the same run on the same
//! database: a plain `INSERT` + commit (what a first execution must at least do) and a
//! primary-key `SELECT` (what a replay must at least do). One client, sequential requests.
//!
//! `cargo bench -p idempotent-tests --bench stores`; PostgreSQL only with `DATABASE_URL`.

use criterion::{Criterion, criterion_group, criterion_main};
use idempotent_core::{engine::*, fingerprint::*, store::*, *};
use idempotent_tests::execute::{Execute, Handled, Outcome};
use idempotent_tests::fixtures::{
    mysql_drop, mysql_pool, mysql_store, pg_drop, pg_pool, pg_store, unique_table,
};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

static NEXT: AtomicU64 = AtomicU64::new(0);

fn next_key() -> String {
    format!("bench-{:012}", NEXT.fetch_add(1, Ordering::Relaxed))
}

fn fp() -> Fingerprint {
    Fingerprint::compute(&FingerprintInput {
        method: "POST",
        path: "/v1/charges",
        query: None,
        content_type: Some("application/json"),
        body: br#"{"amount":500}"#,
    })
}

fn request(key: &str) -> ExecuteRequest {
    ExecuteRequest {
        scope: Scope::new("acct_bench").expect("scope"),
        key: IdempotencyKey::parse(key.as_bytes()),
        fingerprint: fp(),
    }
}

const BODY: &[u8] = br#"{"id":"ch_123","object":"charge","amount":500,"currency":"usd"}"#;

fn handled() -> Handled<()> {
    Handled {
        value: (),
        record: StoredResponse::new(201, BODY)
            .with_header("content-type", "application/json")
            .into(),
    }
}

fn first_execution(c: &mut Criterion, rt: &tokio::runtime::Runtime, name: &str, engine: &Engine) {
    let policy = Policy::default();
    c.bench_function(&format!("{name}/first_execution"), |b| {
        b.to_async(rt).iter(|| async {
            let out = engine
                .execute(request(&next_key()), &policy, || async { handled() })
                .await;
            assert!(matches!(
                out,
                Outcome::Executed {
                    recorded: Recorded::Stored,
                    ..
                }
            ));
        })
    });
}

fn replay(c: &mut Criterion, rt: &tokio::runtime::Runtime, name: &str, engine: &Engine) {
    let policy = Policy::default();
    let key = next_key();
    rt.block_on(engine.execute(request(&key), &policy, || async { handled() }));
    c.bench_function(&format!("{name}/replay"), |b| {
        b.to_async(rt).iter(|| async {
            let out = engine
                .execute(request(&key), &policy, || async { handled() })
                .await;
            assert!(matches!(out, Outcome::Replayed(_)));
        })
    });
}

fn sqlite(c: &mut Criterion, rt: &tokio::runtime::Runtime) {
    let dir = tempfile::tempdir().expect("tempdir");
    let url = format!("sqlite://{}", dir.path().join("bench.db").display());
    let store = rt.block_on(async {
        let s = SqliteStore::connect(&url).await.expect("open");
        s.migrate().await.expect("migrate");
        sqlx::raw_sql("CREATE TABLE floor (k TEXT PRIMARY KEY, v BLOB NOT NULL)")
            .execute(s.pool())
            .await
            .expect("floor table");
        s
    });
    let pool = store.pool().clone();
    let engine = Engine::new(store);
    c.bench_function("sqlite_file/floor_insert", |b| {
        b.to_async(rt).iter(|| async {
            sqlx::query("INSERT INTO floor (k, v) VALUES (?1, ?2)")
                .bind(next_key())
                .bind(BODY)
                .execute(&pool)
                .await
                .expect("insert");
        })
    });
    first_execution(c, rt, "sqlite_file", &engine);
    let k = next_key();
    rt.block_on(
        sqlx::query("INSERT INTO floor (k, v) VALUES (?1, ?2)")
            .bind(&k)
            .bind(BODY)
            .execute(&pool),
    )
    .expect("seed");
    c.bench_function("sqlite_file/floor_select", |b| {
        b.to_async(rt).iter(|| async {
            let v: Vec<u8> = sqlx::query_scalar("SELECT v FROM floor WHERE k = ?1")
                .bind(&k)
                .fetch_one(&pool)
                .await
                .expect("select");
            assert_eq!(v.len(), BODY.len());
        })
    });
    replay(c, rt, "sqlite_file", &engine);
}

fn postgres(c: &mut Criterion, rt: &tokio::runtime::Runtime) {
    if std::env::var("DATABASE_URL").is_err() {
        eprintln!("postgres benches skipped: DATABASE_URL is not set");
        return;
    }
    let table = unique_table("bench");
    let (store, pool) = rt.block_on(async {
        let pool = pg_pool(4).await;
        let store = pg_store(pool.clone(), &table).await;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE idempotent_test.{table}_floor (k text PRIMARY KEY, v bytea NOT NULL)"
        )))
        .execute(&pool)
        .await
        .expect("floor table");
        (store, pool)
    });
    let insert = format!("INSERT INTO idempotent_test.{table}_floor (k, v) VALUES ($1, $2)");
    let select = format!("SELECT v FROM idempotent_test.{table}_floor WHERE k = $1");
    let engine = Engine::new(store);
    c.bench_function("postgres/floor_insert", |b| {
        b.to_async(rt).iter(|| async {
            sqlx::query(sqlx::AssertSqlSafe(insert.as_str()))
                .bind(next_key())
                .bind(BODY)
                .execute(&pool)
                .await
                .expect("insert");
        })
    });
    first_execution(c, rt, "postgres", &engine);
    let k = next_key();
    rt.block_on(
        sqlx::query(sqlx::AssertSqlSafe(insert.as_str()))
            .bind(&k)
            .bind(BODY)
            .execute(&pool),
    )
    .expect("seed");
    c.bench_function("postgres/floor_select", |b| {
        b.to_async(rt).iter(|| async {
            let v: Vec<u8> = sqlx::query_scalar(sqlx::AssertSqlSafe(select.as_str()))
                .bind(&k)
                .fetch_one(&pool)
                .await
                .expect("select");
            assert_eq!(v.len(), BODY.len());
        })
    });
    replay(c, rt, "postgres", &engine);
    rt.block_on(async {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP TABLE IF EXISTS idempotent_test.{table}_floor"
        )))
        .execute(&pool)
        .await
        .expect("drop floor");
        pg_drop(&pool, &table).await;
    });
}

fn mysql(c: &mut Criterion, rt: &tokio::runtime::Runtime) {
    if std::env::var("MYSQL_URL").is_err() {
        eprintln!("mysql benches skipped: MYSQL_URL is not set");
        return;
    }
    let table = unique_table("bench");
    let (store, pool) = rt.block_on(async {
        let pool = mysql_pool(4).await;
        let store = mysql_store(pool.clone(), &table).await;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE {table}_floor (k VARCHAR(64) PRIMARY KEY, v LONGBLOB NOT NULL) ENGINE = InnoDB"
        )))
        .execute(&pool)
        .await
        .expect("floor table");
        (store, pool)
    });
    let insert = format!("INSERT INTO {table}_floor (k, v) VALUES (?, ?)");
    let select = format!("SELECT v FROM {table}_floor WHERE k = ?");
    let engine = Engine::new(store);
    c.bench_function("mysql/floor_insert", |b| {
        b.to_async(rt).iter(|| async {
            sqlx::query(sqlx::AssertSqlSafe(insert.as_str()))
                .bind(next_key())
                .bind(BODY)
                .execute(&pool)
                .await
                .expect("insert");
        })
    });
    first_execution(c, rt, "mysql", &engine);
    let k = next_key();
    rt.block_on(
        sqlx::query(sqlx::AssertSqlSafe(insert.as_str()))
            .bind(&k)
            .bind(BODY)
            .execute(&pool),
    )
    .expect("seed");
    c.bench_function("mysql/floor_select", |b| {
        b.to_async(rt).iter(|| async {
            let v: Vec<u8> = sqlx::query_scalar(sqlx::AssertSqlSafe(select.as_str()))
                .bind(&k)
                .fetch_one(&pool)
                .await
                .expect("select");
            assert_eq!(v.len(), BODY.len());
        })
    });
    replay(c, rt, "mysql", &engine);
    rt.block_on(async {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP TABLE IF EXISTS {table}_floor"
        )))
        .execute(&pool)
        .await
        .expect("drop floor");
        mysql_drop(&pool, &table).await;
    });
}

fn benches(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    sqlite(c, &rt);
    postgres(c, &rt);
    mysql(c, &rt);
}

criterion_group! {
    name = stores;
    config = Criterion::default().measurement_time(Duration::from_secs(4)).warm_up_time(Duration::from_secs(1));
    targets = benches
}
criterion_main!(stores);
