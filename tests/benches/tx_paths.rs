//! Transactional mode's commit paths under concurrency, through the engine (no HTTP): first
//! executions per second with 64 concurrent tasks, each inserting one business row, against
//! a bare handler doing the same INSERT in its own transaction. Arms alternate, 3 rounds,
//! medians. `cargo bench -p idempotent-tests --bench tx_paths` (MySQL from `MYSQL_URL` and
//! PostgreSQL from `DATABASE_URL`, each skipped without it).
#![allow(clippy::unwrap_used, missing_docs)]

use idempotent_core::sqlx::{self, AssertSqlSafe};
use idempotent_core::{engine::*, fingerprint::*, store::*, tx::*, *};
use std::sync::Arc;
use std::time::{Duration, Instant};

const TASKS: usize = 64;
const SECS: u64 = 4;

fn key() -> RecordKey {
    RecordKey::new(
        Scope::new("bench").unwrap(),
        IdempotencyKey::parse(uuid::Uuid::new_v4().to_string().as_bytes()).unwrap(),
    )
}

fn request(key: &RecordKey) -> ExecuteRequest {
    ExecuteRequest {
        scope: key.scope.clone(),
        key: Ok(key.key.clone()),
        fingerprint: Fingerprint::from_parts(Fingerprint::VERSION, [7; 32]),
    }
}

fn insert_sql(table: &str) -> String {
    format!(
        "INSERT INTO {table} (id) VALUES ('{}')",
        uuid::Uuid::new_v4().simple()
    )
}

#[derive(Clone, Copy, Debug)]
enum Arm {
    Bare,
    Tx(CommitPath),
    /// Single commit without the read-first fast path.
    SingleNoRead,
}

async fn one<DB: TxDatabase>(engine: &Engine, arm: Arm, table: &str)
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    let (commit, read_first) = match arm {
        Arm::Tx(commit) => (commit, true),
        Arm::SingleNoRead => (CommitPath::Single, false),
        Arm::Bare => {
            // The bare handler: BEGIN, INSERT, COMMIT on the store's pool.
            let store = engine.transactional_store::<DB>().unwrap();
            let mut tx = DB::begin_tx(&store, None, None).await.unwrap();
            sqlx::raw_sql(AssertSqlSafe(insert_sql(table)))
                .execute(&mut *tx)
                .await
                .unwrap();
            tx.commit().await.unwrap();
            return;
        }
    };
    let k = key();
    let options = TxOptions {
        commit,
        wait: Duration::from_millis(50),
        max_waiters: 4,
        read_first,
    };
    let TxBegin::Run(mut execution) = engine
        .begin_transactional::<DB>(request(&k), &Policy::default(), &options)
        .await
    else {
        panic!("a fresh key is claimed")
    };
    let mut tx = execution.transaction().unwrap();
    sqlx::raw_sql(AssertSqlSafe(insert_sql(table)))
        .execute(&mut *tx)
        .await
        .unwrap();
    drop(tx);
    let out = execution
        .finish(StoredResponse::new(201, r#"{"id":"x"}"#).into())
        .await;
    assert!(matches!(out, TxFinished::Committed), "{out:?}");
}

async fn rate<DB: TxDatabase>(engine: &Engine, arm: Arm, table: &str) -> f64
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    let deadline = Instant::now() + Duration::from_secs(SECS);
    let done = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..TASKS {
        let (engine, table, done) = (engine.clone(), table.to_owned(), Arc::clone(&done));
        tasks.push(tokio::spawn(async move {
            while Instant::now() < deadline {
                one::<DB>(&engine, arm, &table).await;
                done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    done.load(std::sync::atomic::Ordering::Relaxed) as f64 / SECS as f64
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

async fn compare<DB: TxDatabase>(name: &str, engine: Engine, table: &str)
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    let arms = [
        Arm::Bare,
        Arm::Tx(CommitPath::Single),
        Arm::SingleNoRead,
        Arm::Tx(CommitPath::Two),
    ];
    // Warm-up.
    for arm in arms {
        let _ = rate::<DB>(&engine, arm, table).await;
    }
    let mut results = vec![Vec::new(); arms.len()];
    for _ in 0..3 {
        for (i, arm) in arms.iter().enumerate() {
            results[i].push(rate::<DB>(&engine, *arm, table).await);
        }
    }
    let bare = median(results[0].clone());
    for (arm, r) in arms.iter().zip(results) {
        let m = median(r.clone());
        println!(
            "{name:<10} {:<14} {m:>8.0} /s  ({:.2}x bare)  rounds {:?}",
            format!("{arm:?}"),
            m / bare,
            r.iter().map(|x| x.round()).collect::<Vec<_>>()
        );
    }
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let dir = std::env::temp_dir().join(format!("tx-bench-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let store = SqliteStore::connect(&format!("sqlite://{}", dir.join("b.db").display()))
            .await
            .unwrap();
        store.migrate().await.unwrap();
        sqlx::raw_sql("CREATE TABLE business (id TEXT PRIMARY KEY)")
            .execute(store.pool())
            .await
            .unwrap();
        compare::<sqlx::Sqlite>("sqlite", Engine::new(store), "business").await;
        let _ = std::fs::remove_dir_all(&dir);

        if let Ok(url) = std::env::var("MYSQL_URL") {
            let pool = sqlx::mysql::MySqlPoolOptions::new()
                .max_connections(TASKS as u32 + 8)
                .test_before_acquire(false)
                .connect(&url)
                .await
                .unwrap();
            let table = format!("bench_{}", uuid::Uuid::new_v4().simple());
            let store = MySqlStore::builder(pool.clone())
                .table(&table)
                .build()
                .unwrap();
            store.migrate().await.unwrap();
            let business = format!("{table}_biz");
            sqlx::raw_sql(AssertSqlSafe(format!(
                "CREATE TABLE {business} (id VARCHAR(64) PRIMARY KEY) ENGINE = InnoDB"
            )))
            .execute(&pool)
            .await
            .unwrap();
            compare::<sqlx::MySql>("mysql", Engine::new(store), &business).await;
            let _ = sqlx::raw_sql(AssertSqlSafe(format!(
                "DROP TABLE {business}, {table}, {table}_migrations"
            )))
            .execute(&pool)
            .await;
        } else {
            println!("mysql      skipped: set MYSQL_URL");
        }

        let Ok(url) = std::env::var("DATABASE_URL") else {
            println!("postgres   skipped: set DATABASE_URL");
            return;
        };
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(TASKS as u32 + 8)
            .test_before_acquire(false)
            .connect(&url)
            .await
            .unwrap();
        let table = format!("bench_{}", uuid::Uuid::new_v4().simple());
        let store = PostgresStore::builder(pool.clone())
            .schema("idempotent_bench")
            .table(&table)
            .build()
            .unwrap();
        store.migrate().await.unwrap();
        let business = format!("idempotent_bench.{table}_biz");
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE TABLE {business} (id text PRIMARY KEY)"
        )))
        .execute(&pool)
        .await
        .unwrap();
        compare::<sqlx::Postgres>("postgres", Engine::new(store), &business).await;
        let _ = sqlx::raw_sql(AssertSqlSafe(
            "DROP SCHEMA idempotent_bench CASCADE".to_owned(),
        ))
        .execute(&pool)
        .await;
    });
}
