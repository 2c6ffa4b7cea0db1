//! A fake payment provider that deduplicates by the idempotency key its caller sends, as
//! Stripe does: the same key gets the same payment back, never a second one.
//!
//! It keeps its payments **outside** the charges API's transaction, as a real provider does:
//! a payment survives when the API's handler is killed after calling it (a PostgreSQL or MySQL
//! table written on its own connection, in its own commit; on SQLite a file of its own next to the
//! API's, since the API's transaction holds SQLite's one write lock). So when the retry runs
//! the handler again, only a key derived from the request's own key
//! (`Idempotent::derive`) keeps the provider from charging twice.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// A payment the provider made (or, as [`Provider::pay`]'s argument, is asked to make).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Payment {
    /// `py_` + 24 hex characters.
    pub id: String,
    /// Who paid.
    pub account: String,
    /// The customer charged.
    pub customer: String,
    /// Amount, smallest currency unit.
    pub amount: i64,
    /// Currency code.
    pub currency: String,
}

/// Why the provider refused.
#[derive(Debug, thiserror::Error)]
pub enum ProviderError {
    /// The key was used before for another payment (another account or amount).
    #[error("idempotency key reused for a different payment")]
    KeyReused,
    /// Its database failed.
    #[error("payment provider database error: {0}")]
    Db(#[from] sqlx::Error),
}

/// The provider's ledger.
#[derive(Debug, Clone)]
pub enum Provider {
    /// In-process (`--database memory`: nothing survives the process there anyway).
    Memory(Arc<Mutex<HashMap<String, Payment>>>),
    /// A SQLite file of its own.
    Sqlite(sqlx::SqlitePool),
    /// A table on the PostgreSQL database, written outside the API's transactions.
    Postgres(sqlx::PgPool),
    /// A table on the MySQL or MariaDB database, written outside the API's transactions.
    MySql(sqlx::MySqlPool),
}

type Row = (String, String, String, i64, String);

impl Provider {
    /// The provider for the API's database `url`: in-process for `memory`, the file
    /// `FILE.provider` for `sqlite://FILE` (a private in-memory database for
    /// `sqlite::memory:`), and the table `provider_charges` for PostgreSQL and MySQL, on a pool
    /// of its own (it is another system: a handler holding one of the API's connections in its
    /// transaction must never wait for the API's pool to reach it).
    ///
    /// # Errors
    /// When its database cannot be opened or its table created.
    pub async fn open(url: &str) -> Result<Self, sqlx::Error> {
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(8)
                .test_before_acquire(false)
                .acquire_timeout(std::time::Duration::from_secs(5))
                .connect(url)
                .await?;
            // Serialised with the API's own table creation (see `charges::open`).
            sqlx::raw_sql(
                "SELECT pg_advisory_xact_lock(7201012);
                 CREATE TABLE IF NOT EXISTS provider_charges (
                    key text PRIMARY KEY, id text NOT NULL, account text NOT NULL,
                    customer text NOT NULL, amount bigint NOT NULL, currency text NOT NULL);
                 CREATE INDEX IF NOT EXISTS provider_charges_account ON provider_charges (account);",
            )
            .execute(&pool)
            .await?;
            return Ok(Provider::Postgres(pool));
        }
        if crate::charges::is_mysql(url) {
            let pool = sqlx::mysql::MySqlPoolOptions::new()
                .max_connections(8)
                .test_before_acquire(false)
                .acquire_timeout(std::time::Duration::from_secs(5))
                .connect(url)
                .await?;
            // `key` is a reserved word in MySQL. Keys and accounts are compared byte for byte
            // (`VARBINARY`, read back with `CAST(… AS CHAR)`), as on the other databases.
            sqlx::raw_sql(
                "CREATE TABLE IF NOT EXISTS provider_charges (
                    `key` VARBINARY(255) PRIMARY KEY, id VARBINARY(64) NOT NULL,
                    account VARBINARY(1024) NOT NULL, customer MEDIUMTEXT NOT NULL,
                    amount BIGINT NOT NULL, currency VARCHAR(3) NOT NULL,
                    KEY provider_charges_account (account(255))
                 ) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4",
            )
            .execute(&pool)
            .await?;
            return Ok(Provider::MySql(pool));
        }
        if url == "memory" || crate::charges::is_redis(url) {
            return Ok(Provider::Memory(Arc::default()));
        }
        use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
        use std::str::FromStr;
        let (options, max) = if url.contains(":memory:") {
            (SqliteConnectOptions::from_str("sqlite::memory:")?, 1)
        } else {
            let (path, query) = url.split_once('?').unwrap_or((url, ""));
            let own = if query.is_empty() {
                format!("{path}.provider")
            } else {
                format!("{path}.provider?{query}")
            };
            (
                SqliteConnectOptions::from_str(&own)?
                    .create_if_missing(true)
                    .journal_mode(SqliteJournalMode::Wal),
                4,
            )
        };
        let pool = SqlitePoolOptions::new()
            .max_connections(max)
            .test_before_acquire(false)
            .connect_with(options.busy_timeout(std::time::Duration::from_secs(5)))
            .await?;
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS provider_charges (
                key TEXT PRIMARY KEY, id TEXT NOT NULL, account TEXT NOT NULL,
                customer TEXT NOT NULL, amount INTEGER NOT NULL, currency TEXT NOT NULL);
             CREATE INDEX IF NOT EXISTS provider_charges_account ON provider_charges (account);",
        )
        .execute(&pool)
        .await?;
        Ok(Provider::Sqlite(pool))
    }

    /// Makes `payment` (its `id` is ignored) under the caller's idempotency `key`: a new
    /// payment the first time, the same payment for every later call with the key.
    ///
    /// # Errors
    /// [`ProviderError::KeyReused`] when the key's payment has other parameters (as Stripe
    /// refuses a key reused with other parameters); database failures.
    pub async fn pay(&self, key: &str, payment: &Payment) -> Result<Payment, ProviderError> {
        let fresh = Payment {
            id: format!("py_{}", &uuid::Uuid::new_v4().simple().to_string()[..24]),
            ..payment.clone()
        };
        let stored = match self {
            Provider::Memory(map) => map
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .entry(key.to_owned())
                .or_insert(fresh.clone())
                .clone(),
            // Insert-or-keep, then read what is there: two concurrent calls with one key
            // agree on one payment (the primary key decides).
            Provider::Sqlite(pool) => {
                sqlx::query("INSERT INTO provider_charges (key, id, account, customer, amount, currency) VALUES (?1, ?2, ?3, ?4, ?5, ?6) ON CONFLICT (key) DO NOTHING")
                    .bind(key).bind(&fresh.id).bind(&fresh.account).bind(&fresh.customer).bind(fresh.amount).bind(&fresh.currency)
                    .execute(pool).await?;
                let row: Row = sqlx::query_as(
                    "SELECT id, account, customer, amount, currency FROM provider_charges WHERE key = ?1",
                )
                .bind(key)
                .fetch_one(pool)
                .await?;
                from_row(row)
            }
            Provider::Postgres(pool) => {
                sqlx::query("INSERT INTO provider_charges (key, id, account, customer, amount, currency) VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (key) DO NOTHING")
                    .bind(key).bind(&fresh.id).bind(&fresh.account).bind(&fresh.customer).bind(fresh.amount).bind(&fresh.currency)
                    .execute(pool).await?;
                let row: Row = sqlx::query_as(
                    "SELECT id, account, customer, amount, currency FROM provider_charges WHERE key = $1",
                )
                .bind(key)
                .fetch_one(pool)
                .await?;
                from_row(row)
            }
            Provider::MySql(pool) => {
                // Insert-or-keep: the no-op update keeps the first payment (`INSERT IGNORE`
                // would also turn other errors into warnings).
                sqlx::query("INSERT INTO provider_charges (`key`, id, account, customer, amount, currency) VALUES (?, ?, ?, ?, ?, ?) ON DUPLICATE KEY UPDATE `key` = `key`")
                    .bind(key).bind(&fresh.id).bind(&fresh.account).bind(&fresh.customer).bind(fresh.amount).bind(&fresh.currency)
                    .execute(pool).await?;
                let row: Row = sqlx::query_as(
                    "SELECT CAST(id AS CHAR), CAST(account AS CHAR), customer, amount, currency FROM provider_charges WHERE `key` = ?",
                )
                .bind(key)
                .fetch_one(pool)
                .await?;
                from_row(row)
            }
        };
        let asked = Payment {
            id: stored.id.clone(),
            ..payment.clone()
        };
        if asked != stored {
            return Err(ProviderError::KeyReused);
        }
        Ok(stored)
    }

    /// How many payments `account` has made.
    ///
    /// # Errors
    /// Database failures.
    pub async fn payments(&self, account: &str) -> Result<usize, ProviderError> {
        let n: i64 = match self {
            Provider::Memory(map) => {
                let map = map.lock().unwrap_or_else(|e| e.into_inner());
                return Ok(map.values().filter(|p| p.account == account).count());
            }
            Provider::Sqlite(pool) => {
                sqlx::query_scalar("SELECT count(*) FROM provider_charges WHERE account = ?1")
                    .bind(account)
                    .fetch_one(pool)
                    .await?
            }
            Provider::Postgres(pool) => {
                sqlx::query_scalar("SELECT count(*) FROM provider_charges WHERE account = $1")
                    .bind(account)
                    .fetch_one(pool)
                    .await?
            }
            Provider::MySql(pool) => {
                sqlx::query_scalar("SELECT count(*) FROM provider_charges WHERE account = ?")
                    .bind(account)
                    .fetch_one(pool)
                    .await?
            }
        };
        Ok(usize::try_from(n).unwrap_or(0))
    }
}

fn from_row((id, account, customer, amount, currency): Row) -> Payment {
    Payment {
        id,
        account,
        customer,
        amount,
        currency,
    }
}
