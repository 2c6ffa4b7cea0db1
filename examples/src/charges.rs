//! The charges API contract, independent of the web framework.

use idempotent_core::{MemoryStore, MySqlStore, PostgresStore, RedisStore, SqliteStore, Store};
use serde::Serialize;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A charge, as the API returns it.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Charge {
    /// `ch_` + 24 hex characters.
    pub id: String,
    /// Always `"charge"`.
    pub object: &'static str,
    /// The account (bearer token) that created it.
    pub account: String,
    /// Amount in the currency's smallest unit, > 0.
    pub amount: i64,
    /// Three-letter currency code, lower case.
    pub currency: String,
    /// The customer charged.
    pub customer: String,
    /// Creation time, Unix seconds.
    pub created: i64,
    /// The payment provider's payment (in the answer to the POST that created the charge).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub payment: Option<String>,
}

/// A validated request to create a charge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewCharge {
    /// > 0.
    pub amount: i64,
    /// Three ASCII letters, lower-cased.
    pub currency: String,
    /// Non-empty.
    pub customer: String,
}

/// Why a charge request is refused (answered with 400 before any key is claimed).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidCharge {
    /// The body is not JSON / form data of the expected shape.
    #[error("the body is not a valid {0} charge request")]
    Malformed(&'static str),
    /// The content type is neither JSON nor form.
    #[error("send the charge as `application/json` or `application/x-www-form-urlencoded`")]
    UnsupportedMediaType,
    /// A required field is absent.
    #[error("missing field `{0}`")]
    Missing(&'static str),
    /// `amount` is not a positive integer.
    #[error("`amount` must be a positive integer (smallest currency unit)")]
    Amount,
    /// `currency` is not three letters.
    #[error("`currency` must be a three-letter code such as `usd`")]
    Currency,
    /// `customer` is empty.
    #[error("`customer` must not be empty")]
    Customer,
}

impl NewCharge {
    /// Parses and validates a body by its content type: JSON `{"amount": 500, "currency":
    /// "usd", "customer": "cus_123"}` or form `amount=500&currency=usd&customer=cus_123`.
    ///
    /// # Errors
    /// [`InvalidCharge`] describing the first problem found.
    pub fn parse(content_type: Option<&str>, body: &[u8]) -> Result<Self, InvalidCharge> {
        let media = content_type
            .and_then(|c| c.split(';').next())
            .map(|m| m.trim().to_ascii_lowercase())
            .unwrap_or_default();
        let (amount, currency, customer) = match media.as_str() {
            "application/json" => {
                let v: serde_json::Value =
                    serde_json::from_slice(body).map_err(|_| InvalidCharge::Malformed("JSON"))?;
                let obj = v.as_object().ok_or(InvalidCharge::Malformed("JSON"))?;
                let amount = match obj.get("amount") {
                    None => return Err(InvalidCharge::Missing("amount")),
                    Some(a) => a.as_i64().ok_or(InvalidCharge::Amount)?,
                };
                let text = |name: &'static str| -> Result<String, InvalidCharge> {
                    match obj.get(name) {
                        None => Err(InvalidCharge::Missing(name)),
                        Some(serde_json::Value::String(s)) => Ok(s.clone()),
                        Some(_) => Err(if name == "currency" {
                            InvalidCharge::Currency
                        } else {
                            InvalidCharge::Customer
                        }),
                    }
                };
                (amount, text("currency")?, text("customer")?)
            }
            "application/x-www-form-urlencoded" => {
                let mut amount = None;
                let mut currency = None;
                let mut customer = None;
                for (k, v) in form_urlencoded::parse(body) {
                    match k.as_ref() {
                        "amount" => amount = Some(v.into_owned()),
                        "currency" => currency = Some(v.into_owned()),
                        "customer" => customer = Some(v.into_owned()),
                        _ => {}
                    }
                }
                let amount = amount
                    .ok_or(InvalidCharge::Missing("amount"))?
                    .parse::<i64>()
                    .map_err(|_| InvalidCharge::Amount)?;
                (
                    amount,
                    currency.ok_or(InvalidCharge::Missing("currency"))?,
                    customer.ok_or(InvalidCharge::Missing("customer"))?,
                )
            }
            _ => return Err(InvalidCharge::UnsupportedMediaType),
        };
        if amount <= 0 {
            return Err(InvalidCharge::Amount);
        }
        if currency.len() != 3 || !currency.bytes().all(|b| b.is_ascii_alphabetic()) {
            return Err(InvalidCharge::Currency);
        }
        if customer.trim().is_empty() {
            return Err(InvalidCharge::Customer);
        }
        Ok(NewCharge {
            amount,
            currency: currency.to_ascii_lowercase(),
            customer,
        })
    }
}

fn now_secs() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

fn new_id(prefix: &str) -> String {
    let id = uuid::Uuid::new_v4().simple().to_string();
    format!("{prefix}_{}", &id[..24])
}

/// A refund of (part of) a charge.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Refund {
    /// `re_` + 24 hex characters.
    pub id: String,
    /// Always `"refund"`.
    pub object: &'static str,
    /// The refunded charge.
    pub charge: String,
    /// Amount refunded, > 0 and at most the charge's amount.
    pub amount: i64,
    /// Creation time, Unix seconds.
    pub created: i64,
}

/// A validated request to refund a charge: `{"amount": 100}`, `amount=100`, or an empty body
/// for the whole amount.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NewRefund {
    /// The amount, or `None` for the charge's whole amount.
    pub amount: Option<i64>,
}

impl NewRefund {
    /// Parses and validates a refund body (see the type's docs).
    ///
    /// # Errors
    /// [`InvalidCharge`] describing the problem.
    pub fn parse(content_type: Option<&str>, body: &[u8]) -> Result<Self, InvalidCharge> {
        if body.iter().all(u8::is_ascii_whitespace) {
            return Ok(NewRefund { amount: None });
        }
        let media = content_type
            .and_then(|c| c.split(';').next())
            .map(|m| m.trim().to_ascii_lowercase())
            .unwrap_or_default();
        let amount = match media.as_str() {
            "application/json" => {
                let v: serde_json::Value =
                    serde_json::from_slice(body).map_err(|_| InvalidCharge::Malformed("JSON"))?;
                let obj = v.as_object().ok_or(InvalidCharge::Malformed("JSON"))?;
                match obj.get("amount") {
                    None => None,
                    Some(a) => Some(a.as_i64().ok_or(InvalidCharge::Amount)?),
                }
            }
            "application/x-www-form-urlencoded" => form_urlencoded::parse(body)
                .find(|(k, _)| k == "amount")
                .map(|(_, v)| v.parse::<i64>().map_err(|_| InvalidCharge::Amount))
                .transpose()?,
            _ => return Err(InvalidCharge::UnsupportedMediaType),
        };
        if amount.is_some_and(|a| a <= 0) {
            return Err(InvalidCharge::Amount);
        }
        Ok(NewRefund { amount })
    }
}

impl Refund {
    /// A new refund of `amount` on `charge` (fresh id, created now).
    pub fn new(charge: &str, amount: i64) -> Self {
        Refund {
            id: new_id("re"),
            object: "refund",
            charge: charge.to_owned(),
            amount,
            created: now_secs(),
        }
    }
}

impl Charge {
    /// A new charge for `account` (fresh id, created now).
    pub fn new(account: &str, req: NewCharge) -> Self {
        let created = now_secs();
        Charge {
            id: new_id("ch"),
            object: "charge",
            account: account.to_owned(),
            amount: req.amount,
            currency: req.currency,
            customer: req.customer,
            created,
            payment: None,
        }
    }
}

/// Where charges and refunds are written: the same database as the idempotency store.
#[derive(Debug, Clone)]
pub enum Charges {
    /// In-process lists (`--database memory`).
    Memory(Arc<Mutex<MemoryTables>>),
    /// A SQLite table.
    Sqlite(sqlx::SqlitePool),
    /// A PostgreSQL table.
    Postgres(sqlx::PgPool),
    /// A MySQL or MariaDB table.
    MySql(sqlx::MySqlPool),
}

/// Where a route's writes go: the tables' pools (plain mode, and the memory store), or the
/// transaction the idempotency record commits with (transactional mode: the charge row and
/// the stored response commit together, or neither does).
#[derive(Debug)]
pub enum Writer<'a> {
    /// The pool of [`Charges`] (each statement commits on its own).
    Pool,
    /// A SQLite transaction.
    Sqlite(&'a mut sqlx::SqliteConnection),
    /// A PostgreSQL transaction.
    Postgres(&'a mut sqlx::PgConnection),
    /// A MySQL or MariaDB transaction.
    MySql(&'a mut sqlx::MySqlConnection),
}

/// A charges-table failure.
#[derive(Debug, thiserror::Error)]
#[error("charges database error: {0}")]
pub struct DbError(#[from] sqlx::Error);

/// The in-process tables of `--database memory`.
#[derive(Debug, Default)]
pub struct MemoryTables {
    /// Charges, oldest first.
    pub charges: Vec<Charge>,
    /// Refunds, oldest first.
    pub refunds: Vec<Refund>,
}

type Row = (String, String, i64, String, String, i64);
type RefundRow = (String, String, i64, i64);

fn refund_from_row((id, charge, amount, created): RefundRow) -> Refund {
    Refund {
        id,
        object: "refund",
        charge,
        amount,
        created,
    }
}

fn from_row((id, account, amount, currency, customer, created): Row) -> Charge {
    Charge {
        id,
        object: "charge",
        account,
        amount,
        currency,
        customer,
        created,
        payment: None,
    }
}

// MySQL: the columns compared in a `WHERE` (ids, accounts) are `VARBINARY`, compared byte for
// byte as on PostgreSQL and SQLite (under a text collation `Acct` and `acct`, or `ch_1` and
// `ch_1 `, could be one value); they are read back as text with `CAST(… AS CHAR)`.

/// MySQL: this account's charges, oldest first.
const MYSQL_LIST: &str = "SELECT CAST(id AS CHAR), CAST(account AS CHAR), amount, currency, customer, created FROM charges WHERE account = ? ORDER BY seq";

/// MySQL: one charge of an account.
const MYSQL_GET: &str = "SELECT CAST(id AS CHAR), CAST(account AS CHAR), amount, currency, customer, created FROM charges WHERE account = ? AND id = ?";

/// MySQL: a charge's refunds, oldest first.
const MYSQL_REFUNDS: &str = "SELECT CAST(id AS CHAR), CAST(charge AS CHAR), amount, created FROM refunds WHERE charge = ? ORDER BY seq";

/// MySQL: the tables, created if missing. InnoDB, text in `utf8mb4`; `seq` orders the lists as
/// the other databases' do. (`CREATE TABLE IF NOT EXISTS` is safe against itself on MySQL,
/// which serialises it on the table's metadata lock: no lock of our own, unlike PostgreSQL.)
/// The indexes are declared in the tables (MySQL has no `CREATE INDEX IF NOT EXISTS`); an
/// account is a scope (at most 1,024 bytes), indexed on its first 255 bytes.
const MYSQL_TABLES: &str = "CREATE TABLE IF NOT EXISTS charges (
        seq BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY, id VARBINARY(64) NOT NULL UNIQUE,
        account VARBINARY(1024) NOT NULL, amount BIGINT NOT NULL, currency VARCHAR(3) NOT NULL,
        customer MEDIUMTEXT NOT NULL, created BIGINT NOT NULL,
        KEY charges_account (account(255), seq)
    ) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;
    CREATE TABLE IF NOT EXISTS refunds (
        seq BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY, id VARBINARY(64) NOT NULL UNIQUE,
        charge VARBINARY(64) NOT NULL, amount BIGINT NOT NULL, created BIGINT NOT NULL,
        KEY refunds_charge (charge, seq)
    ) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;";

/// Which database the tables (and the idempotency store) are on: it picks the handlers
/// (transactional on SQLite, PostgreSQL and MySQL, plain on memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `--database memory`.
    Memory,
    /// SQLite.
    Sqlite,
    /// PostgreSQL.
    Postgres,
    /// MySQL or MariaDB.
    MySql,
}

impl Charges {
    /// The database kind.
    pub fn kind(&self) -> Kind {
        match self {
            Charges::Memory(_) => Kind::Memory,
            Charges::Sqlite(_) => Kind::Sqlite,
            Charges::Postgres(_) => Kind::Postgres,
            Charges::MySql(_) => Kind::MySql,
        }
    }

    /// Writes a charge.
    ///
    /// # Errors
    /// [`DbError`] when the database fails.
    pub async fn insert(&self, w: &mut Writer<'_>, c: &Charge) -> Result<(), DbError> {
        match self {
            Charges::Memory(tables) => {
                tables
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .charges
                    .push(c.clone());
                Ok(())
            }
            Charges::Sqlite(pool) => {
                let q = sqlx::query("INSERT INTO charges (id, account, amount, currency, customer, created) VALUES (?1, ?2, ?3, ?4, ?5, ?6)")
                    .bind(&c.id).bind(&c.account).bind(c.amount).bind(&c.currency).bind(&c.customer).bind(c.created);
                match w {
                    Writer::Sqlite(tx) => q.execute(&mut **tx).await?,
                    _ => q.execute(pool).await?,
                };
                Ok(())
            }
            Charges::Postgres(pool) => {
                let q = sqlx::query("INSERT INTO charges (id, account, amount, currency, customer, created) VALUES ($1, $2, $3, $4, $5, $6)")
                    .bind(&c.id).bind(&c.account).bind(c.amount).bind(&c.currency).bind(&c.customer).bind(c.created);
                match w {
                    Writer::Postgres(tx) => q.execute(&mut **tx).await?,
                    _ => q.execute(pool).await?,
                };
                Ok(())
            }
            Charges::MySql(pool) => {
                let q = sqlx::query("INSERT INTO charges (id, account, amount, currency, customer, created) VALUES (?, ?, ?, ?, ?, ?)")
                    .bind(&c.id).bind(&c.account).bind(c.amount).bind(&c.currency).bind(&c.customer).bind(c.created);
                match w {
                    Writer::MySql(tx) => q.execute(&mut **tx).await?,
                    _ => q.execute(pool).await?,
                };
                Ok(())
            }
        }
    }

    /// This account's charges, oldest first.
    ///
    /// # Errors
    /// [`DbError`] when the database fails.
    pub async fn list(&self, account: &str) -> Result<Vec<Charge>, DbError> {
        match self {
            Charges::Memory(tables) => Ok(tables
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .charges
                .iter()
                .filter(|c| c.account == account)
                .cloned()
                .collect()),
            Charges::Sqlite(pool) => {
                let rows: Vec<Row> = sqlx::query_as("SELECT id, account, amount, currency, customer, created FROM charges WHERE account = ?1 ORDER BY seq")
                    .bind(account)
                    .fetch_all(pool)
                    .await?;
                Ok(rows.into_iter().map(from_row).collect())
            }
            Charges::Postgres(pool) => {
                let rows: Vec<Row> = sqlx::query_as("SELECT id, account, amount, currency, customer, created FROM charges WHERE account = $1 ORDER BY seq")
                    .bind(account)
                    .fetch_all(pool)
                    .await?;
                Ok(rows.into_iter().map(from_row).collect())
            }
            Charges::MySql(pool) => {
                let rows: Vec<Row> = sqlx::query_as(MYSQL_LIST)
                    .bind(account)
                    .fetch_all(pool)
                    .await?;
                Ok(rows.into_iter().map(from_row).collect())
            }
        }
    }
}

impl Charges {
    /// The account's charge `id`, if it exists, read through `w`: inside a transactional
    /// handler, on its own transaction (a second pooled connection there could wait for the
    /// pool its own transactions fill).
    ///
    /// # Errors
    /// [`DbError`] when the database fails.
    pub async fn get(
        &self,
        w: &mut Writer<'_>,
        account: &str,
        id: &str,
    ) -> Result<Option<Charge>, DbError> {
        match self {
            Charges::Memory(tables) => Ok(tables
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .charges
                .iter()
                .find(|c| c.account == account && c.id == id)
                .cloned()),
            Charges::Sqlite(pool) => {
                let q = sqlx::query_as("SELECT id, account, amount, currency, customer, created FROM charges WHERE account = ?1 AND id = ?2")
                    .bind(account).bind(id);
                let row: Option<Row> = match w {
                    Writer::Sqlite(tx) => q.fetch_optional(&mut **tx).await?,
                    _ => q.fetch_optional(pool).await?,
                };
                Ok(row.map(from_row))
            }
            Charges::Postgres(pool) => {
                let q = sqlx::query_as("SELECT id, account, amount, currency, customer, created FROM charges WHERE account = $1 AND id = $2")
                    .bind(account).bind(id);
                let row: Option<Row> = match w {
                    Writer::Postgres(tx) => q.fetch_optional(&mut **tx).await?,
                    _ => q.fetch_optional(pool).await?,
                };
                Ok(row.map(from_row))
            }
            Charges::MySql(pool) => {
                let q = sqlx::query_as(MYSQL_GET).bind(account).bind(id);
                let row: Option<Row> = match w {
                    Writer::MySql(tx) => q.fetch_optional(&mut **tx).await?,
                    _ => q.fetch_optional(pool).await?,
                };
                Ok(row.map(from_row))
            }
        }
    }

    /// Writes a refund.
    ///
    /// # Errors
    /// [`DbError`] when the database fails.
    pub async fn insert_refund(&self, w: &mut Writer<'_>, r: &Refund) -> Result<(), DbError> {
        match self {
            Charges::Memory(tables) => {
                tables
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .refunds
                    .push(r.clone());
                Ok(())
            }
            Charges::Sqlite(pool) => {
                let q = sqlx::query(
                    "INSERT INTO refunds (id, charge, amount, created) VALUES (?1, ?2, ?3, ?4)",
                )
                .bind(&r.id)
                .bind(&r.charge)
                .bind(r.amount)
                .bind(r.created);
                match w {
                    Writer::Sqlite(tx) => q.execute(&mut **tx).await?,
                    _ => q.execute(pool).await?,
                };
                Ok(())
            }
            Charges::Postgres(pool) => {
                let q = sqlx::query(
                    "INSERT INTO refunds (id, charge, amount, created) VALUES ($1, $2, $3, $4)",
                )
                .bind(&r.id)
                .bind(&r.charge)
                .bind(r.amount)
                .bind(r.created);
                match w {
                    Writer::Postgres(tx) => q.execute(&mut **tx).await?,
                    _ => q.execute(pool).await?,
                };
                Ok(())
            }
            Charges::MySql(pool) => {
                let q = sqlx::query(
                    "INSERT INTO refunds (id, charge, amount, created) VALUES (?, ?, ?, ?)",
                )
                .bind(&r.id)
                .bind(&r.charge)
                .bind(r.amount)
                .bind(r.created);
                match w {
                    Writer::MySql(tx) => q.execute(&mut **tx).await?,
                    _ => q.execute(pool).await?,
                };
                Ok(())
            }
        }
    }

    /// The refunds of charge `charge`, oldest first.
    ///
    /// # Errors
    /// [`DbError`] when the database fails.
    pub async fn refunds(&self, charge: &str) -> Result<Vec<Refund>, DbError> {
        match self {
            Charges::Memory(tables) => Ok(tables
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .refunds
                .iter()
                .filter(|r| r.charge == charge)
                .cloned()
                .collect()),
            Charges::Sqlite(pool) => {
                let rows: Vec<RefundRow> = sqlx::query_as("SELECT id, charge, amount, created FROM refunds WHERE charge = ?1 ORDER BY seq")
                    .bind(charge)
                    .fetch_all(pool)
                    .await?;
                Ok(rows.into_iter().map(refund_from_row).collect())
            }
            Charges::Postgres(pool) => {
                let rows: Vec<RefundRow> = sqlx::query_as("SELECT id, charge, amount, created FROM refunds WHERE charge = $1 ORDER BY seq")
                    .bind(charge)
                    .fetch_all(pool)
                    .await?;
                Ok(rows.into_iter().map(refund_from_row).collect())
            }
            Charges::MySql(pool) => {
                let rows: Vec<RefundRow> = sqlx::query_as(MYSQL_REFUNDS)
                    .bind(charge)
                    .fetch_all(pool)
                    .await?;
                Ok(rows.into_iter().map(refund_from_row).collect())
            }
        }
    }
}

/// Why the database could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// Not `memory`, `sqlite:…`, `postgres://…`, `mysql://…`, `mariadb://…`, `redis://…` or
    /// `redis+cluster://…`.
    #[error(
        "unsupported database URL `{0}`: use `memory`, `sqlite://FILE`, `sqlite::memory:`, `postgres://…`, `mysql://…` (or `mariadb://…`), `redis://host:port` or `redis+cluster://host:port,…`"
    )]
    Unsupported(String),
    /// Connecting to Redis failed.
    #[error(transparent)]
    Redis(#[from] idempotent_core::store::RedisSetupError),
    /// Setting up the idempotency store failed.
    #[error(transparent)]
    Setup(#[from] idempotent_core::SetupError),
    /// Creating the charges table (or the provider's) failed.
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

/// Whether `url` names MySQL or MariaDB (`mysql://`, `mariadb://`: sqlx accepts both).
pub fn is_mysql(url: &str) -> bool {
    url.starts_with("mysql://") || url.starts_with("mariadb://")
}

/// Whether `url` names Redis (`redis://`, `rediss://`, `redis+cluster://`, `rediss+cluster://`).
pub fn is_redis(url: &str) -> bool {
    url.starts_with("redis://")
        || url.starts_with("rediss://")
        || url.starts_with("redis+cluster://")
        || url.starts_with("rediss+cluster://")
}

/// Opens the database named by `url`: the idempotency store (migrated) and the charges table
/// (created if missing), on one database. On Redis (`redis://…`, `redis+cluster://…`) the
/// records live in Redis and the charges in the process's memory (Redis holds no business
/// tables: each instance lists the charges it made); `redis_wait` replicas must acknowledge
/// each claim and each stored response there (`WAIT`, 1 s), when given.
///
/// # Errors
/// [`OpenError`].
pub async fn open(
    url: &str,
    redis_wait: Option<u32>,
) -> Result<(Arc<dyn Store>, Charges), OpenError> {
    if is_redis(url) {
        let mut builder = RedisStore::builder();
        if let Some(n) = redis_wait {
            builder = builder.wait_for_replicas(n, Duration::from_secs(1));
        }
        let store = builder.connect(url).await?;
        return Ok((Arc::new(store), Charges::Memory(Arc::default())));
    }
    if url == "memory" {
        return Ok((
            Arc::new(MemoryStore::new()),
            Charges::Memory(Arc::default()),
        ));
    }
    if url.starts_with("sqlite:") {
        let store = SqliteStore::connect(url).await?;
        store.migrate().await?;
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS charges (
                seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, account TEXT NOT NULL,
                amount INTEGER NOT NULL, currency TEXT NOT NULL, customer TEXT NOT NULL, created INTEGER NOT NULL);
             CREATE INDEX IF NOT EXISTS charges_account ON charges (account, seq);
             CREATE TABLE IF NOT EXISTS refunds (
                seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, charge TEXT NOT NULL,
                amount INTEGER NOT NULL, created INTEGER NOT NULL);
             CREATE INDEX IF NOT EXISTS refunds_charge ON refunds (charge, seq);",
        )
        .execute(store.pool())
        .await?;
        let charges = Charges::Sqlite(store.pool().clone());
        return Ok((Arc::new(store), charges));
    }
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(16)
            .test_before_acquire(false)
            .acquire_timeout(Duration::from_secs(5))
            .connect(url)
            .await?;
        let store = PostgresStore::new(pool.clone())?;
        store.migrate().await?;
        // The lock (held to the end of this one implicit transaction): servers starting
        // together on a fresh database would otherwise race on the catalog (`CREATE TABLE IF
        // NOT EXISTS` is not safe against itself there).
        sqlx::raw_sql(
            "SELECT pg_advisory_xact_lock(7201012);
             CREATE TABLE IF NOT EXISTS charges (
                seq bigserial PRIMARY KEY, id text NOT NULL UNIQUE, account text NOT NULL,
                amount bigint NOT NULL, currency text NOT NULL, customer text NOT NULL, created bigint NOT NULL);
             CREATE INDEX IF NOT EXISTS charges_account ON charges (account, seq);
             CREATE TABLE IF NOT EXISTS refunds (
                seq bigserial PRIMARY KEY, id text NOT NULL UNIQUE, charge text NOT NULL,
                amount bigint NOT NULL, created bigint NOT NULL);
             CREATE INDEX IF NOT EXISTS refunds_charge ON refunds (charge, seq);",
        )
        .execute(&pool)
        .await?;
        return Ok((Arc::new(store), Charges::Postgres(pool)));
    }
    if is_mysql(url) {
        let pool = sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(16)
            // A ping before every statement would double its round trips.
            .test_before_acquire(false)
            .acquire_timeout(Duration::from_secs(5))
            .connect(url)
            .await?;
        let store = MySqlStore::new(pool.clone())?;
        store.migrate().await?;
        sqlx::raw_sql(MYSQL_TABLES).execute(&pool).await?;
        return Ok((Arc::new(store), Charges::MySql(pool)));
    }
    Err(OpenError::Unsupported(url.to_owned()))
}

/// The secret downstream keys are derived under when none is configured: made once, stored
/// in the database (table `example_settings`) and read back by every later start and every
/// other instance on that database, so derived keys survive restarts. (`memory`: made per
/// process, which is as long as its records live.) A production service takes it from its
/// secret manager instead (`--derive-secret` / `IDEMPOTENCY_SECRET`).
///
/// # Errors
/// [`DbError`] when the database fails.
pub async fn stored_secret(charges: &Charges) -> Result<String, DbError> {
    let fresh = format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    );
    Ok(setting(charges, "derive_secret", &fresh)
        .await?
        .unwrap_or(fresh))
}

/// Records `check` (a value identifying the derive secret) unless one is recorded; whether
/// the recorded one is `check`. Always true on `memory`.
///
/// # Errors
/// [`DbError`] when the database fails.
pub async fn agree_on_secret(charges: &Charges, check: &str) -> Result<bool, DbError> {
    Ok(setting(charges, "derive_secret_check", check)
        .await?
        .is_none_or(|stored| stored == check))
}

/// The setting `name` of table `example_settings`, set to `value` first unless it is set
/// (insert-or-keep, then read: instances starting together agree on the first written).
/// `None` on `memory`, which has no such table.
async fn setting(charges: &Charges, name: &str, value: &str) -> Result<Option<String>, DbError> {
    let stored = match charges {
        Charges::Memory(_) => return Ok(None),
        Charges::Sqlite(pool) => {
            sqlx::raw_sql("CREATE TABLE IF NOT EXISTS example_settings (name TEXT PRIMARY KEY, value TEXT NOT NULL)")
                .execute(pool).await?;
            sqlx::query("INSERT INTO example_settings (name, value) VALUES (?1, ?2) ON CONFLICT (name) DO NOTHING")
                .bind(name).bind(value).execute(pool).await?;
            sqlx::query_scalar("SELECT value FROM example_settings WHERE name = ?1")
                .bind(name)
                .fetch_one(pool)
                .await?
        }
        Charges::Postgres(pool) => {
            // The lock: see `open`.
            sqlx::raw_sql("SELECT pg_advisory_xact_lock(7201012); CREATE TABLE IF NOT EXISTS example_settings (name text PRIMARY KEY, value text NOT NULL)")
                .execute(pool).await?;
            sqlx::query("INSERT INTO example_settings (name, value) VALUES ($1, $2) ON CONFLICT (name) DO NOTHING")
                .bind(name).bind(value).execute(pool).await?;
            sqlx::query_scalar("SELECT value FROM example_settings WHERE name = $1")
                .bind(name)
                .fetch_one(pool)
                .await?
        }
        Charges::MySql(pool) => {
            // Insert-or-keep: the no-op update keeps the first value (`INSERT IGNORE` would
            // also turn other errors into warnings).
            sqlx::raw_sql("CREATE TABLE IF NOT EXISTS example_settings (name VARBINARY(64) PRIMARY KEY, value TEXT NOT NULL) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4")
                .execute(pool).await?;
            sqlx::query("INSERT INTO example_settings (name, value) VALUES (?, ?) ON DUPLICATE KEY UPDATE name = name")
                .bind(name).bind(value).execute(pool).await?;
            sqlx::query_scalar("SELECT value FROM example_settings WHERE name = ?")
                .bind(name)
                .fetch_one(pool)
                .await?
        }
    };
    Ok(Some(stored))
}

/// Parses a `--lease` / `--work-delay` value (`0ms` allowed for the delay).
///
/// # Errors
/// The duration grammar's message.
pub fn parse_delay(s: &str) -> Result<Duration, String> {
    if s.strip_suffix("ms")
        .or_else(|| s.strip_suffix('s'))
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b == b'0'))
    {
        return Ok(Duration::ZERO);
    }
    idempotent_core::parse_duration(s).map_err(|e| e.to_string())
}

/// Parses a `--lease` value (must be > 0).
///
/// # Errors
/// The duration grammar's message.
pub fn parse_lease(s: &str) -> Result<Duration, String> {
    idempotent_core::parse_duration(s).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation() {
        let json = Some("application/json");
        let form = Some("application/x-www-form-urlencoded");
        let ok = NewCharge {
            amount: 500,
            currency: "usd".into(),
            customer: "cus_1".into(),
        };
        assert_eq!(
            NewCharge::parse(
                json,
                br#"{"amount":500,"currency":"USD","customer":"cus_1"}"#
            ),
            Ok(ok.clone())
        );
        assert_eq!(
            NewCharge::parse(form, b"customer=cus_1&amount=500&currency=usd"),
            Ok(ok)
        );
        assert_eq!(
            NewCharge::parse(json, br#"{"amount":0,"currency":"usd","customer":"c"}"#),
            Err(InvalidCharge::Amount)
        );
        assert_eq!(
            NewCharge::parse(json, br#"{"amount":5,"currency":"us","customer":"c"}"#),
            Err(InvalidCharge::Currency)
        );
        assert_eq!(
            NewCharge::parse(json, br#"{"amount":5,"currency":"usd"}"#),
            Err(InvalidCharge::Missing("customer"))
        );
        assert_eq!(
            NewCharge::parse(json, b"{"),
            Err(InvalidCharge::Malformed("JSON"))
        );
        assert_eq!(
            NewCharge::parse(form, b"amount=x&currency=usd&customer=c"),
            Err(InvalidCharge::Amount)
        );
        assert_eq!(
            NewCharge::parse(Some("text/plain"), b""),
            Err(InvalidCharge::UnsupportedMediaType)
        );
        assert_eq!(NewRefund::parse(None, b""), Ok(NewRefund { amount: None }));
        assert_eq!(
            NewRefund::parse(json, br#"{"amount": 100}"#),
            Ok(NewRefund { amount: Some(100) })
        );
        assert_eq!(
            NewRefund::parse(form, b"amount=-1"),
            Err(InvalidCharge::Amount)
        );
        assert_eq!(parse_delay("0ms"), Ok(Duration::ZERO));
        assert_eq!(parse_delay("5s"), Ok(Duration::from_secs(5)));
        assert!(parse_lease("0s").is_err());
    }
}
