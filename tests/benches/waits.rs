//! Waiting for the first attempt's answer (a route's `wait`), measured per store:
//!
//! - **wake latency**: instance A claims a key; 4 duplicates wait on instance B (another engine
//!   over another store value on the same records, so on PostgreSQL and Redis the answer
//!   travels as a notification, on SQLite and MySQL by polling, and on memory in process);
//!   A completes. The time from the start of A's complete to each waiter's answer (a replay),
//!   median and p99 over 50 keys × 4 waiters, beside the complete's own time;
//! - **first executions, notifications on vs off** (PostgreSQL): claims and completes of new
//!   keys by 8 concurrent tasks for 3 s, alternating `notify_changes(true)` and `(false)`, 3
//!   rounds each (what waiting costs requests that never wait: the `pg_notify` each complete
//!   sends).
//!
//! `cargo bench -p idempotent-tests --bench waits`; each remote store with its URL variable
//! (`DATABASE_URL`, `MYSQL_URL`, `REDIS_URL`, `REDIS_CLUSTER_URL`), skipped without it.

use idempotent_core::engine::{Begin, ExecuteRequest, Policy};
use idempotent_core::fingerprint::{Fingerprint, FingerprintInput};
use idempotent_core::store::StoredResponse;
use idempotent_core::{Engine, IdempotencyKey, MemoryStore, Scope, Store};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn request(key: &str) -> ExecuteRequest {
    ExecuteRequest {
        scope: Scope::new("acct_bench").expect("scope"),
        key: IdempotencyKey::parse(key.as_bytes()),
        fingerprint: Fingerprint::compute(&FingerprintInput {
            method: "POST",
            path: "/v1/charges",
            query: None,
            content_type: Some("application/json"),
            body: br#"{"amount":500}"#,
        }),
    }
}

fn policy() -> Policy {
    Policy {
        lease: Duration::from_secs(10),
        wait: Duration::from_secs(5),
        ..Policy::default()
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn ms(d: Duration) -> String {
    format!("{:.2}", d.as_secs_f64() * 1e3)
}

/// Wake latency between instance `a` and `b` (engines over two store values on one set of
/// records): one line of the table.
async fn wake_latency(name: &str, a: Arc<dyn Store>, b: Arc<dyn Store>) {
    let (a, b) = (Engine::from_arc(a), Engine::from_arc(b));
    let policy = policy();
    let mut latencies = Vec::new();
    let mut completes = Vec::new();
    for i in 0..50 {
        let key = format!("wake-{}-{i}", uuid::Uuid::new_v4().simple());
        let Begin::Claimed(first) = a.begin(request(&key), &policy).await else {
            panic!("{name}: the first did not claim")
        };
        let waiters: Vec<_> = (0..4)
            .map(|_| {
                let (b, key) = (b.clone(), key.clone());
                tokio::spawn(async move {
                    let begin = b.begin(request(&key), &policy).await;
                    (Instant::now(), matches!(begin, Begin::Replay(_)))
                })
            })
            .collect();
        while b.waiting() < 4 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        // Past the waiters' first looks and a listener's start.
        tokio::time::sleep(Duration::from_millis(if i == 0 { 300 } else { 30 })).await;
        let started = Instant::now();
        first.finish(StoredResponse::new(201, "ch").into()).await;
        completes.push(started.elapsed());
        for waiter in waiters {
            let (answered, replayed) = waiter.await.expect("join");
            assert!(
                replayed,
                "{name}: a waiter was not answered with the replay"
            );
            latencies.push(answered.saturating_duration_since(started));
        }
    }
    latencies.sort_unstable();
    completes.sort_unstable();
    println!(
        "| {name} | {} | {} | {} |",
        ms(percentile(&latencies, 0.5)),
        ms(percentile(&latencies, 0.99)),
        ms(percentile(&completes, 0.5)),
    );
}

/// First executions per second on `store` by 8 concurrent tasks for 3 s.
async fn first_executions(store: Arc<dyn Store>) -> f64 {
    let engine = Engine::from_arc(store);
    let policy = Policy::default();
    let deadline = Instant::now() + Duration::from_secs(3);
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let engine = engine.clone();
            tokio::spawn(async move {
                let mut n = 0_u64;
                while Instant::now() < deadline {
                    let key = uuid::Uuid::new_v4().simple().to_string();
                    let Begin::Claimed(execution) = engine.begin(request(&key), &policy).await
                    else {
                        panic!("a new key did not claim")
                    };
                    execution
                        .finish(StoredResponse::new(201, "ch").into())
                        .await;
                    n += 1;
                }
                n
            })
        })
        .collect();
    let mut total = 0;
    for task in tasks {
        total += task.await.expect("join");
    }
    total as f64 / 3.0
}

/// A PostgreSQL store on `table`, notifying changes or not.
fn pg_store(pool: &sqlx::PgPool, table: &str, notify: bool) -> Arc<idempotent_core::PostgresStore> {
    Arc::new(
        idempotent_core::PostgresStore::builder(pool.clone())
            .table(table)
            .notify_changes(notify)
            .build()
            .expect("store"),
    )
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    println!(
        "| store | waiter answered, median (ms) | p99 (ms) | the complete itself, median (ms) |"
    );
    println!("|---|---|---|---|");
    let memory = MemoryStore::new();
    wake_latency(
        "memory (in process)",
        Arc::new(memory.clone()),
        Arc::new(memory),
    )
    .await;

    let dir = tempfile::tempdir().expect("tempdir");
    let url = format!("sqlite://{}", dir.path().join("waits.db").display());
    let sqlite = || async {
        Arc::new(
            idempotent_core::SqliteStore::connect(&url)
                .await
                .expect("sqlite"),
        )
    };
    let a = sqlite().await;
    a.migrate().await.expect("migrate");
    wake_latency("SQLite (another pool: polling)", a, sqlite().await).await;

    let mut pg = None;
    if std::env::var("DATABASE_URL").is_ok() {
        let pool = idempotent_tests::fixtures::pg_pool(16).await;
        let table = idempotent_tests::fixtures::unique_table("bench_waits");
        pg_store(&pool, &table, true)
            .migrate()
            .await
            .expect("migrate");
        wake_latency(
            "PostgreSQL (LISTEN/NOTIFY)",
            pg_store(&pool, &table, true),
            pg_store(&pool, &table, true),
        )
        .await;
        pg = Some((pool, table));
    }
    if std::env::var("MYSQL_URL").is_ok() {
        let pool = idempotent_tests::fixtures::mysql_pool(16).await;
        let table = idempotent_tests::fixtures::unique_table("bench_waits");
        let a = idempotent_tests::fixtures::mysql_store(pool.clone(), &table).await;
        let b = idempotent_core::MySqlStore::builder(pool.clone())
            .table(&table)
            .build()
            .expect("store");
        wake_latency("MySQL (polling)", Arc::new(a), Arc::new(b)).await;
        idempotent_tests::fixtures::mysql_drop(&pool, &table).await;
    }
    for (var, name) in [
        ("REDIS_URL", "Redis (pub/sub)"),
        ("REDIS_CLUSTER_URL", "Redis Cluster (pub/sub)"),
    ] {
        if let Ok(url) = std::env::var(var) {
            let fixture = idempotent_tests::fixtures::Redis::on(url);
            let a = fixture.store().await;
            let prefix = a.prefix().to_owned();
            let b = fixture.store_on(&prefix).await;
            wake_latency(name, Arc::new(a), Arc::new(b)).await;
            idempotent_tests::Fixture::cleanup(&fixture).await;
        }
    }

    if let Some((pool, table)) = pg {
        let (mut on, mut off) = (Vec::new(), Vec::new());
        for _ in 0..3 {
            on.push(first_executions(pg_store(&pool, &table, true)).await);
            off.push(first_executions(pg_store(&pool, &table, false)).await);
        }
        on.sort_by(f64::total_cmp);
        off.sort_by(f64::total_cmp);
        println!();
        println!(
            "PostgreSQL first executions/s (8 tasks, medians of 3 alternating rounds): notify on {:.0} ({on:.0?}), off {:.0} ({off:.0?})",
            on[1], off[1]
        );
        idempotent_tests::fixtures::pg_drop(&pool, &table).await;
    }
}
