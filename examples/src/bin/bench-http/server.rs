//! What every benchmark server shares: the handler's work, the database, the execution count.

use idempotent_core::{MySqlStore, PostgresStore, SqliteStore, Store};
use serde::Deserialize;
use serde_json::json;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// The schema (PostgreSQL) holding the benchmark's tables, dropped when a run starts.
pub(crate) const PG_SCHEMA: &str = "bench_http";

/// The tables (MySQL) of the benchmark, in the database its URL names: the store's records
/// (with its migrations' table) and the orders, dropped when a run starts and when it ends.
pub(crate) const MYSQL_TABLES: [&str; 3] = [
    MYSQL_RECORDS,
    "bench_http_records_migrations",
    "bench_http_orders",
];

/// The store's table on MySQL.
const MYSQL_RECORDS: &str = "bench_http_records";

/// An order as the client posts it: the handler parses it (serde) in every arm.
#[derive(Debug, Deserialize)]
pub(crate) struct NewOrder {
    pub(crate) amount: i64,
    pub(crate) currency: String,
    pub(crate) description: String,
    pub(crate) metadata: serde_json::Map<String, serde_json::Value>,
}

/// Where the handler writes.
#[derive(Debug, Clone)]
pub(crate) enum Db {
    Memory,
    Sqlite(sqlx::SqlitePool),
    Postgres(sqlx::PgPool),
    MySql(sqlx::MySqlPool),
}

/// The server's state: its database and how many times the handler ran.
#[derive(Debug, Clone)]
pub(crate) struct Bench {
    pub(crate) db: Db,
    executions: Arc<AtomicU64>,
    tag: Arc<str>,
}

/// A connection the handler's INSERT runs on.
pub(crate) enum Conn<'a> {
    Sqlite(&'a mut sqlx::SqliteConnection),
    Postgres(&'a mut sqlx::PgConnection),
    MySql(&'a mut sqlx::MySqlConnection),
}

impl Bench {
    /// Counts one execution and returns the new order's id.
    pub(crate) fn execute(&self) -> String {
        let n = self.executions.fetch_add(1, Ordering::Relaxed);
        format!("ord_{}_{n}", self.tag)
    }

    pub(crate) fn executions(&self) -> u64 {
        self.executions.load(Ordering::Relaxed)
    }

    /// The bare handler's write: one INSERT in its own transaction (nothing on memory).
    pub(crate) async fn insert_alone(
        &self,
        id: &str,
        account: &str,
        order: &NewOrder,
    ) -> Result<(), sqlx::Error> {
        match &self.db {
            Db::Memory => Ok(()),
            Db::Sqlite(pool) => {
                let mut tx = pool.begin().await?;
                insert(Conn::Sqlite(&mut tx), id, account, order).await?;
                tx.commit().await
            }
            Db::Postgres(pool) => {
                let mut tx = pool.begin().await?;
                insert(Conn::Postgres(&mut tx), id, account, order).await?;
                tx.commit().await
            }
            Db::MySql(pool) => {
                let mut tx = pool.begin().await?;
                insert(Conn::MySql(&mut tx), id, account, order).await?;
                tx.commit().await
            }
        }
    }
}

/// The handler's one business INSERT.
pub(crate) async fn insert(
    conn: Conn<'_>,
    id: &str,
    account: &str,
    order: &NewOrder,
) -> Result<(), sqlx::Error> {
    match conn {
        Conn::Sqlite(c) => {
            sqlx::query("INSERT INTO orders (id, account, amount, currency, description) VALUES (?, ?, ?, ?, ?)")
                .bind(id)
                .bind(account)
                .bind(order.amount)
                .bind(&order.currency)
                .bind(&order.description)
                .execute(c)
                .await?;
        }
        Conn::Postgres(c) => {
            sqlx::query("INSERT INTO bench_http.orders (id, account, amount, currency, description) VALUES ($1, $2, $3, $4, $5)")
                .bind(id)
                .bind(account)
                .bind(order.amount)
                .bind(&order.currency)
                .bind(&order.description)
                .execute(c)
                .await?;
        }
        Conn::MySql(c) => {
            sqlx::query("INSERT INTO bench_http_orders (id, account, amount, currency, description) VALUES (?, ?, ?, ?, ?)")
                .bind(id)
                .bind(account)
                .bind(order.amount)
                .bind(&order.currency)
                .bind(&order.description)
                .execute(c)
                .await?;
        }
    }
    Ok(())
}

/// The JSON object every arm answers with (201).
pub(crate) fn created(id: &str, order: &NewOrder) -> serde_json::Value {
    json!({
        "id": id,
        "object": "order",
        "amount": order.amount,
        "currency": order.currency,
        "description": order.description,
        "metadata": order.metadata,
        "status": "created",
    })
}

/// The prefix of the benchmark's Redis records (each server's tag follows it).
const REDIS_PREFIX: &str = "bench-http:";

/// Deletes the benchmark's records from every primary of `url` (best effort: a record left
/// behind expires with its ttl).
pub(crate) async fn redis_cleanup(url: &str) {
    let nodes = match url.strip_prefix("redis+cluster://") {
        Some(seeds) => cluster_primaries(seeds).await,
        None => vec![url.to_owned()],
    };
    for node in nodes {
        let Ok(client) = redis::Client::open(node.as_str()) else {
            continue;
        };
        let Ok(mut conn) = client.get_multiplexed_async_connection().await else {
            continue;
        };
        let mut cursor = 0u64;
        loop {
            let Ok((next, keys)): redis::RedisResult<(u64, Vec<Vec<u8>>)> = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(format!("{REDIS_PREFIX}*"))
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut conn)
                .await
            else {
                break;
            };
            for key in keys {
                let _: redis::RedisResult<i64> =
                    redis::cmd("UNLINK").arg(key).query_async(&mut conn).await;
            }
            if next == 0 {
                break;
            }
            cursor = next;
        }
    }
}

/// The primaries of the cluster whose nodes include `seeds` (`host:port,…`), as URLs.
async fn cluster_primaries(seeds: &str) -> Vec<String> {
    for seed in seeds.split(',') {
        let Ok(client) = redis::Client::open(format!("redis://{seed}")) else {
            continue;
        };
        let Ok(mut conn) = client.get_multiplexed_async_connection().await else {
            continue;
        };
        let Ok(nodes): redis::RedisResult<String> = redis::cmd("CLUSTER")
            .arg("NODES")
            .query_async(&mut conn)
            .await
        else {
            continue;
        };
        return nodes
            .lines()
            .filter_map(|line| {
                let f: Vec<&str> = line.split(' ').collect();
                let addr = f.get(1)?.split('@').next()?;
                f.get(2)?
                    .contains("master")
                    .then(|| format!("redis://{addr}"))
            })
            .collect();
    }
    Vec::new()
}

/// Opens the database for a server: `memory`, `sqlite://FILE`, `postgres://…`, `mysql://…` or
/// `redis://…`, with the store the annotated arms use (the same database, so transactional mode
/// can join it).
pub(crate) async fn open(
    url: &str,
    tag: &str,
    pool_size: u32,
) -> Result<(Bench, Arc<dyn Store>), String> {
    let err = |e: &dyn std::fmt::Display| format!("{url}: {e}");
    let (db, store): (Db, Arc<dyn Store>) = if url == "memory" {
        (
            Db::Memory,
            Arc::new(
                // Unbounded, in records and in bytes: one caller sends every key of the run
                // (hundreds of thousands, more than the default 32 MiB a scope may hold).
                idempotent_core::MemoryStore::builder()
                    .max_entries(usize::MAX)
                    .max_per_scope(usize::MAX)
                    .max_bytes(u64::MAX)
                    .max_bytes_per_scope(u64::MAX)
                    .build(),
            ),
        )
    } else if idempotent_examples::charges::is_redis(url) {
        // The bare handler writes nothing, as on memory: the arms differ by the store alone.
        // Unbounded per caller, as on memory: one caller sends every key of the run, 64 at
        // once (64 reservations of 1 MiB are past the default 32 MiB a scope may hold).
        let store = idempotent_core::RedisStore::builder()
            .max_per_scope(u64::MAX)
            .max_bytes_per_scope(u64::MAX)
            .prefix(&format!("{REDIS_PREFIX}{tag}:"))
            .connect(url)
            .await
            .map_err(|e| err(&e))?;
        (Db::Memory, Arc::new(store))
    } else if url.starts_with("sqlite:") {
        // Each server is its file's only writer: its transactions queue for the write lock
        // (`queue_transactions`, off by default), as such a server should.
        let pool = SqliteStore::connect(url)
            .await
            .map_err(|e| err(&e))?
            .pool()
            .clone();
        let store = SqliteStore::builder(pool)
            .queue_transactions(idempotent_core::store::DEFAULT_BUSY_TIMEOUT)
            .build()
            .map_err(|e| err(&e))?;
        store.migrate().await.map_err(|e| err(&e))?;
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY, account TEXT NOT NULL,
             amount INTEGER NOT NULL, currency TEXT NOT NULL, description TEXT NOT NULL)",
        )
        .execute(store.pool())
        .await
        .map_err(|e| err(&e))?;
        (Db::Sqlite(store.pool().clone()), Arc::new(store))
    } else if idempotent_examples::charges::is_mysql(url) {
        let pool = sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(pool_size)
            .test_before_acquire(false)
            .connect(url)
            .await
            .map_err(|e| err(&e))?;
        let store = MySqlStore::builder(pool.clone())
            .table(MYSQL_RECORDS)
            .build()
            .map_err(|e| err(&e))?;
        store.migrate().await.map_err(|e| err(&e))?;
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS bench_http_orders (id VARCHAR(64) PRIMARY KEY,
             account VARCHAR(255) NOT NULL, amount BIGINT NOT NULL, currency VARCHAR(16) NOT NULL,
             description TEXT NOT NULL) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4",
        )
        .execute(&pool)
        .await
        .map_err(|e| err(&e))?;
        (Db::MySql(pool), Arc::new(store))
    } else {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(pool_size)
            .test_before_acquire(false)
            .connect(url)
            .await
            .map_err(|e| err(&e))?;
        let store = PostgresStore::builder(pool.clone())
            .schema(PG_SCHEMA)
            .build()
            .map_err(|e| err(&e))?;
        store.migrate().await.map_err(|e| err(&e))?;
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS bench_http.orders (id text PRIMARY KEY, account text NOT NULL,
             amount bigint NOT NULL, currency text NOT NULL, description text NOT NULL)",
        )
        .execute(&pool)
        .await
        .map_err(|e| err(&e))?;
        (Db::Postgres(pool), Arc::new(store))
    };
    Ok((
        Bench {
            db,
            executions: Arc::default(),
            tag: tag.into(),
        },
        store,
    ))
}
