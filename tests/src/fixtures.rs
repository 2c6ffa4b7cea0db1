//! Fixtures for the SQL stores and Redis: real databases, fresh tables (or key prefixes) per
//! test.

use crate::Fixture;
use idempotent_core::Store;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The PostgreSQL URL the tests use, from `DATABASE_URL`.
///
/// # Panics
/// When `DATABASE_URL` is unset: the PostgreSQL tests are compiled `#[ignore]`d in that case,
/// so reaching this without it is a setup error worth failing loudly on.
pub fn database_url() -> String {
    std::env::var("DATABASE_URL").expect("DATABASE_URL must point at PostgreSQL for these tests")
}

/// A unique, valid table name.
pub fn unique_table(prefix: &str) -> String {
    format!(
        "{prefix}_{}",
        idempotent_core::uuid::Uuid::new_v4().simple()
    )
}

/// SQLite: a fresh in-memory database per store, or a fresh file in a temp dir.
#[cfg(feature = "sqlite")]
pub struct Sqlite {
    /// Use a file (WAL) instead of memory.
    pub file: bool,
    dir: Mutex<Option<tempfile::TempDir>>,
}

#[cfg(feature = "sqlite")]
impl Sqlite {
    /// In-memory databases.
    pub fn memory() -> Self {
        Sqlite {
            file: false,
            dir: Mutex::new(None),
        }
    }
    /// Database files in a temporary directory (removed on drop).
    pub fn file() -> Self {
        Sqlite {
            file: true,
            dir: Mutex::new(None),
        }
    }
}

#[cfg(feature = "sqlite")]
#[async_trait::async_trait]
impl Fixture for Sqlite {
    async fn fresh(&self) -> Arc<dyn Store> {
        let url = if self.file {
            let mut dir = self.dir.lock().expect("lock");
            let dir = dir.get_or_insert_with(|| tempfile::tempdir().expect("tempdir"));
            format!(
                "sqlite://{}",
                dir.path()
                    .join(format!("{}.db", unique_table("db")))
                    .display()
            )
        } else {
            "sqlite::memory:".to_owned()
        };
        let store = idempotent_core::SqliteStore::connect(&url)
            .await
            .expect("open sqlite");
        store.migrate().await.expect("migrate sqlite");
        Arc::new(store)
    }
    async fn advance(&self, by: Duration) {
        tokio::time::sleep(by).await;
    }
}

/// A [`StallingProxy`](crate::stall::StallingProxy) in front of the database that `url`
/// names, and a pool of up to `max` connections through it that hands out connections
/// untested (a connection the proxy froze is used as it is). `upstream` is the database's
/// address, which `url` must name.
///
/// # Panics
/// When `url` does not name `upstream`, or the database does not answer through the proxy.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub async fn pool_through_proxy<DB: sqlx::Database>(
    url: &str,
    upstream: &str,
    max: u32,
) -> (crate::stall::StallingProxy, sqlx::Pool<DB>) {
    let proxy = crate::stall::StallingProxy::start(upstream.parse().expect("an address")).await;
    let through = url.replace(upstream, &proxy.addr().to_string());
    assert_ne!(through, url, "the database URL must name {upstream}");
    let pool = sqlx::pool::PoolOptions::<DB>::new()
        .max_connections(max)
        .test_before_acquire(false)
        .connect(&through)
        .await
        .expect("the database answers through the proxy");
    (proxy, pool)
}

/// PostgreSQL from `DATABASE_URL`: a fresh table per store in schema `idempotent_test`.
#[cfg(feature = "postgres")]
#[derive(Default)]
pub struct Postgres {
    tables: Mutex<Vec<(sqlx::PgPool, String)>>,
}

#[cfg(feature = "postgres")]
impl Postgres {
    /// The fixture (connects lazily).
    pub fn new() -> Self {
        Self::default()
    }
}

/// A pool on `DATABASE_URL` that does not ping before each use.
#[cfg(feature = "postgres")]
pub async fn pg_pool(max: u32) -> sqlx::PgPool {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(max)
        .test_before_acquire(false)
        .acquire_timeout(Duration::from_secs(10))
        .connect(&database_url())
        .await
        .expect("PostgreSQL from DATABASE_URL is unreachable")
}

/// A migrated store on a fresh table of schema `idempotent_test`.
#[cfg(feature = "postgres")]
pub async fn pg_store(pool: sqlx::PgPool, table: &str) -> idempotent_core::PostgresStore {
    let store = idempotent_core::PostgresStore::builder(pool)
        .schema("idempotent_test")
        .table(table)
        .build()
        .expect("valid names");
    store.migrate().await.expect("migrate postgres");
    store
}

/// Drops a table made by [`pg_store`], its migrations table and its functions.
#[cfg(feature = "postgres")]
pub async fn pg_drop(pool: &sqlx::PgPool, table: &str) {
    let sql = format!(
        "DROP TABLE IF EXISTS idempotent_test.{table}, idempotent_test.{table}_migrations; \
         DROP FUNCTION IF EXISTS idempotent_test.{table}_claim_first, idempotent_test.{table}_complete"
    );
    let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(pool).await;
}

#[cfg(feature = "postgres")]
#[async_trait::async_trait]
impl Fixture for Postgres {
    async fn fresh(&self) -> Arc<dyn Store> {
        let pool = pg_pool(16).await;
        let table = unique_table("t");
        let store = pg_store(pool.clone(), &table).await;
        self.tables.lock().expect("lock").push((pool, table));
        Arc::new(store)
    }
    async fn advance(&self, by: Duration) {
        tokio::time::sleep(by).await;
    }
    async fn cleanup(&self) {
        let tables = std::mem::take(&mut *self.tables.lock().expect("lock"));
        for (pool, table) in tables {
            pg_drop(&pool, &table).await;
        }
    }
}

/// The MySQL / MariaDB URL the tests use, from `MYSQL_URL`.
///
/// # Panics
/// When `MYSQL_URL` is unset: the MySQL tests are compiled `#[ignore]`d in that case.
#[cfg(feature = "mysql")]
pub fn mysql_url() -> String {
    std::env::var("MYSQL_URL").expect("MYSQL_URL must point at MySQL or MariaDB for these tests")
}

/// A pool on `MYSQL_URL` that does not ping before each use.
///
/// # Panics
/// When the server cannot be reached.
#[cfg(feature = "mysql")]
pub async fn mysql_pool(max: u32) -> sqlx::MySqlPool {
    sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(max)
        .test_before_acquire(false)
        .acquire_timeout(Duration::from_secs(10))
        .connect(&mysql_url())
        .await
        .expect("MySQL from MYSQL_URL is unreachable")
}

/// A migrated store on a fresh table.
///
/// # Panics
/// When the migration fails.
#[cfg(feature = "mysql")]
pub async fn mysql_store(pool: sqlx::MySqlPool, table: &str) -> idempotent_core::MySqlStore {
    let store = idempotent_core::MySqlStore::builder(pool)
        .table(table)
        .build()
        .expect("valid name");
    store.migrate().await.expect("migrate mysql");
    store
}

/// Drops a table made by [`mysql_store`] and its migrations table.
#[cfg(feature = "mysql")]
pub async fn mysql_drop(pool: &sqlx::MySqlPool, table: &str) {
    let sql = format!("DROP TABLE IF EXISTS `{table}`, `{table}_migrations`");
    let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(pool).await;
}

/// MySQL or MariaDB from `MYSQL_URL`: a fresh table per store.
#[cfg(feature = "mysql")]
#[derive(Default)]
pub struct MySql {
    tables: Mutex<Vec<(sqlx::MySqlPool, String)>>,
}

#[cfg(feature = "mysql")]
impl MySql {
    /// The fixture (connects lazily).
    pub fn new() -> Self {
        Self::default()
    }
}

#[cfg(feature = "mysql")]
#[async_trait::async_trait]
impl Fixture for MySql {
    async fn fresh(&self) -> Arc<dyn Store> {
        let pool = mysql_pool(16).await;
        let table = unique_table("t");
        let store = mysql_store(pool.clone(), &table).await;
        self.tables.lock().expect("lock").push((pool, table));
        Arc::new(store)
    }
    async fn advance(&self, by: Duration) {
        tokio::time::sleep(by).await;
    }
    async fn cleanup(&self) {
        let tables = std::mem::take(&mut *self.tables.lock().expect("lock"));
        for (pool, table) in tables {
            mysql_drop(&pool, &table).await;
        }
    }
}

/// Redis from `REDIS_URL` (a standalone server) or `REDIS_CLUSTER_URL` (a Redis Cluster,
/// `redis+cluster://host:port,…`): a fresh key prefix per store, its keys deleted by
/// [`Fixture::cleanup`].
#[cfg(feature = "redis")]
pub struct Redis {
    url: String,
    prefixes: Mutex<Vec<String>>,
}

#[cfg(feature = "redis")]
impl Redis {
    /// The standalone server of `REDIS_URL`.
    ///
    /// # Panics
    /// When `REDIS_URL` is unset (the tests are compiled `#[ignore]`d then).
    pub fn standalone() -> Self {
        Self::on(std::env::var("REDIS_URL").expect("REDIS_URL must point at Redis for these tests"))
    }

    /// The cluster of `REDIS_CLUSTER_URL`.
    ///
    /// # Panics
    /// When `REDIS_CLUSTER_URL` is unset (the tests are compiled `#[ignore]`d then).
    pub fn cluster() -> Self {
        Self::on(
            std::env::var("REDIS_CLUSTER_URL")
                .expect("REDIS_CLUSTER_URL must point at a Redis Cluster for these tests"),
        )
    }

    /// Stores on `url` (`redis://…` or `redis+cluster://…`).
    pub fn on(url: String) -> Self {
        Redis {
            url,
            prefixes: Mutex::new(Vec::new()),
        }
    }

    /// The URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// A store on a fresh prefix (`t_<uuid>:`).
    ///
    /// # Panics
    /// When Redis cannot be reached.
    pub async fn store(&self) -> idempotent_core::RedisStore {
        let prefix = format!("{}:", unique_table("t"));
        self.prefixes.lock().expect("lock").push(prefix.clone());
        self.store_on(&prefix).await
    }

    /// A store on `prefix` (another instance's view of the same records).
    ///
    /// # Panics
    /// When Redis cannot be reached.
    pub async fn store_on(&self, prefix: &str) -> idempotent_core::RedisStore {
        idempotent_core::RedisStore::builder()
            .prefix(prefix)
            .connect(&self.url)
            .await
            .unwrap_or_else(|e| panic!("Redis at {} is unreachable: {e}", self.url))
    }
}

/// The primaries of the deployment `url` names, as `redis://host:port`: the server itself, or
/// every primary a cluster's `CLUSTER NODES` lists (not failed).
///
/// # Panics
/// When the server cannot be reached.
#[cfg(feature = "redis")]
pub async fn redis_primaries(url: &str) -> Vec<String> {
    let Some(seeds) = url.strip_prefix("redis+cluster://") else {
        return vec![url.to_owned()];
    };
    let seed = seeds.split(',').next().expect("a seed node");
    let mut conn = redis_node(&format!("redis://{seed}")).await;
    let nodes: String = redis::cmd("CLUSTER")
        .arg("NODES")
        .query_async(&mut conn)
        .await
        .expect("CLUSTER NODES");
    nodes
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split(' ').collect();
            let flags = fields.get(2)?;
            let addr = fields.get(1)?.split('@').next()?;
            (flags.contains("master") && !flags.contains("fail")).then(|| format!("redis://{addr}"))
        })
        .collect()
}

/// A plain connection to one node.
///
/// # Panics
/// When the node cannot be reached.
#[cfg(feature = "redis")]
pub async fn redis_node(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .expect("redis url")
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| panic!("Redis at {url} is unreachable: {e}"))
}

/// The keys under `prefix` on one node (`SCAN`).
///
/// # Panics
/// When the node cannot be reached.
#[cfg(feature = "redis")]
pub async fn redis_keys(node: &str, prefix: &str) -> Vec<Vec<u8>> {
    let mut conn = redis_node(node).await;
    let mut cursor = 0u64;
    let mut keys = Vec::new();
    loop {
        let (next, batch): (u64, Vec<Vec<u8>>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{prefix}*"))
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn)
            .await
            .expect("SCAN");
        keys.extend(batch);
        if next == 0 {
            return keys;
        }
        cursor = next;
    }
}

#[cfg(feature = "redis")]
#[async_trait::async_trait]
impl Fixture for Redis {
    async fn fresh(&self) -> Arc<dyn Store> {
        Arc::new(self.store().await)
    }
    async fn advance(&self, by: Duration) {
        tokio::time::sleep(by).await;
    }
    async fn cleanup(&self) {
        let prefixes = std::mem::take(&mut *self.prefixes.lock().expect("lock"));
        for node in redis_primaries(&self.url).await {
            let mut conn = redis_node(&node).await;
            for prefix in &prefixes {
                for key in redis_keys(&node, prefix).await {
                    let _: Result<i64, _> =
                        redis::cmd("UNLINK").arg(key).query_async(&mut conn).await;
                }
            }
        }
    }
}
