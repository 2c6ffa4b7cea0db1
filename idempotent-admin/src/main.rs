//! Inspect or delete one idempotency record, for support staff: "why did this customer get a
//! 422?", "let this client run its request again".
//!
//! ```text
//! cargo install --path idempotent-admin     # from a checkout of the repository
//! idempotent-admin --database sqlite://charges.db get --scope acct_1 --key 8e03978e-…
//! idempotent-admin --database postgres://… delete --scope acct_1 --key 8e03978e-… [--force]
//! idempotent-admin --database mysql://root@127.0.0.1:3306/app get --scope acct_1 --key 8e03978e-…
//! idempotent-admin --database redis+cluster://127.0.0.1:7000 get --scope acct_1 --key 8e03978e-…
//! ```
//!
//! `get` prints the record as one JSON object: its state (`done` or `in_progress`), the
//! fingerprint (version and SHA-256 digest), when it was created and when it expires (Unix
//! seconds), and for a finished record the stored response's status, header names and body
//! size (`--show-body` adds the body: it may hold personal data). `delete` deletes it and
//! prints what it held. An in-progress record is deleted only with `--force`: a retry could
//! then run the handler while the first execution still runs.
//!
//! Exit codes: 0 done, 1 an error (printed), 2 no such record, 3 the record is in progress
//! and `--force` was not given. The record is named as the application names it: the
//! caller's id (`--scope`, or `--unscoped` for unscoped routes) and the key; for an idempotent
//! function add `--function NAME` (its records are stored under the scope
//! `call:<length of name>:<name>:<scope>`, which `--scope` alone refuses). The table is the
//! stores' default (`idempotency_records`). `get` shows live records only; `delete` also
//! removes an expired row the sweeper has not deleted yet. A single-commit claim inside its
//! still open transaction is invisible to both until it commits. On Redis (`redis://host:port`,
//! or `redis+cluster://host:port,…` for a cluster) the records are those under the store's
//! default key prefix (`idempotent:`; `--prefix` for another), and an expired record is
//! already gone.

use clap::{Parser, Subcommand};
use idempotent_core::{
    IdempotencyKey, MySqlStore, PostgresStore, RedisStore, Scope, SqliteStore, Store,
    store::Deleted, store::Record, store::RecordKey, store::RecordState, store::StoredOutcome,
};
use serde_json::{Value, json};
use std::process::ExitCode;
use std::str::FromStr;
use std::time::{SystemTime, UNIX_EPOCH};

/// Inspect or delete one idempotency record.
#[derive(Debug, Parser)]
#[command(name = "idempotent-admin")]
struct Args {
    /// `sqlite://FILE`, `postgres://…`, `mysql://…` (MySQL or MariaDB; `mariadb://…` too),
    /// `redis://host:port` or `redis+cluster://host:port,…` (defaults to `$DATABASE_URL`).
    #[arg(long)]
    database: Option<String>,
    /// Redis: the key prefix the application's store uses.
    #[arg(long, default_value = "idempotent:")]
    prefix: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print the record of (scope, key).
    Get {
        #[command(flatten)]
        record: Which,
        /// Print the stored response's body too (lossy UTF-8).
        #[arg(long)]
        show_body: bool,
    },
    /// Delete the record of (scope, key) and print what it held.
    Delete {
        #[command(flatten)]
        record: Which,
        /// Delete it even if it is in progress (a retry may then run while the first
        /// execution still runs).
        #[arg(long)]
        force: bool,
    },
}

#[derive(Debug, clap::Args)]
struct Which {
    /// The scope the record is stored under (the caller's id).
    #[arg(long, required_unless_present = "unscoped")]
    scope: Option<String>,
    /// The record of an `unscoped` route (instead of `--scope`).
    #[arg(long, conflicts_with = "scope")]
    unscoped: bool,
    /// The idempotency key, as the client sent it.
    #[arg(long)]
    key: String,
    /// The record of the idempotent function of this name (its `name = "…"`), called by
    /// `--scope` (or `--unscoped`).
    #[arg(long)]
    function: Option<String>,
}

impl Which {
    fn record_key(&self) -> Result<RecordKey, String> {
        let scope = match &self.scope {
            Some(scope) => Scope::new(scope.clone()).map_err(|e| format!("--scope: {e}"))?,
            None => Scope::unscoped(),
        };
        let scope = match &self.function {
            Some(name) => idempotent_core::call::Call::record_scope(name, &scope)
                .map_err(|e| format!("--function: {e}"))?,
            None => scope,
        };
        let key = IdempotencyKey::parse(self.key.as_bytes()).map_err(|e| format!("--key: {e}"))?;
        Ok(RecordKey::new(scope, key))
    }
}

fn unix(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| (d.as_millis() as f64) / 1000.0)
}

/// The record as JSON (the body only with `show_body`).
fn describe(record: &Record, show_body: bool) -> Value {
    let mut out = json!({
        "scope": record.key.scope.as_str(),
        "key": record.key.key.as_str(),
        "fingerprint": record.fingerprint.to_hex(),
        "fingerprint_version": record.fingerprint.version(),
        "created": unix(record.created_at),
        "expires": unix(record.expires_at),
    });
    match &record.state {
        RecordState::InProgress { locked_until, .. } => {
            out["state"] = json!("in_progress");
            out["locked_until"] = json!(unix(*locked_until));
        }
        RecordState::Done {
            outcome,
            completed_at,
        } => {
            out["state"] = json!("done");
            out["completed"] = json!(unix(*completed_at));
            match outcome {
                StoredOutcome::Response(r) => {
                    out["status"] = json!(r.status);
                    let names: Vec<&str> = r.headers.iter().map(|(n, _)| n.as_str()).collect();
                    out["headers"] = json!(names);
                    out["body_bytes"] = json!(r.body.len());
                    if show_body {
                        out["body"] = json!(String::from_utf8_lossy(&r.body));
                    }
                }
                StoredOutcome::Oversized { status, size } => {
                    out["status"] = json!(status);
                    out["oversized"] = json!(true);
                    out["body_bytes"] = json!(size);
                }
            }
        }
    }
    out
}

async fn open(url: &str, prefix: &str) -> Result<Box<dyn Store>, String> {
    if [
        "redis://",
        "rediss://",
        "redis+cluster://",
        "rediss+cluster://",
    ]
    .iter()
    .any(|s| url.starts_with(s))
    {
        let store = RedisStore::builder()
            .prefix(prefix)
            .connect(url)
            .await
            .map_err(|e| format!("cannot open {url}: {e}"))?;
        return Ok(Box::new(store));
    }
    if url.starts_with("sqlite:") {
        // Never create a database: a mistyped path is an error, not a new empty file.
        let options = sqlx::sqlite::SqliteConnectOptions::from_str(url)
            .map_err(|e| e.to_string())?
            .create_if_missing(false);
        if options.get_filename() == std::path::Path::new(":memory:") {
            return Err("an in-memory SQLite database holds no records to inspect".into());
        }
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(options)
            .await
            .map_err(|e| format!("cannot open {url}: {e}"))?;
        let store = SqliteStore::builder(pool)
            .build()
            .map_err(|e| e.to_string())?;
        return Ok(Box::new(store));
    }
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect(url)
            .await
            .map_err(|e| e.to_string())?;
        return Ok(Box::new(
            PostgresStore::new(pool).map_err(|e| e.to_string())?,
        ));
    }
    if url.starts_with("mysql://") || url.starts_with("mariadb://") {
        let pool = sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(1)
            .connect(url)
            .await
            .map_err(|e| e.to_string())?;
        return Ok(Box::new(MySqlStore::new(pool).map_err(|e| e.to_string())?));
    }
    Err(format!(
        "unsupported database URL `{url}`: use sqlite://FILE, postgres://…, mysql://…, redis://… or redis+cluster://…"
    ))
}

async fn run(args: Args) -> Result<ExitCode, String> {
    let url = args
        .database
        .or_else(|| std::env::var("DATABASE_URL").ok())
        .ok_or("give --database URL (or set DATABASE_URL)")?;
    let store = open(&url, &args.prefix).await?;
    let print = |v: Value| println!("{v}");
    match args.command {
        Command::Get { record, show_body } => {
            let key = record.record_key()?;
            match store.get(&key).await.map_err(|e| e.to_string())? {
                Some(found) => {
                    print(describe(&found, show_body));
                    Ok(ExitCode::SUCCESS)
                }
                None => {
                    eprintln!("idempotent-admin: no record for that scope and key");
                    Ok(ExitCode::from(2))
                }
            }
        }
        Command::Delete { record, force } => {
            let key = record.record_key()?;
            match store.delete(&key, force).await.map_err(|e| e.to_string())? {
                Deleted::Deleted(gone) => {
                    let mut out = describe(&gone, false);
                    out["deleted"] = json!(true);
                    print(out);
                    Ok(ExitCode::SUCCESS)
                }
                Deleted::InProgress(running) => {
                    print(describe(&running, false));
                    eprintln!(
                        "idempotent-admin: the record is in progress: its first execution may still run, and deleting it lets a retry run the handler again; add --force to delete it anyway"
                    );
                    Ok(ExitCode::from(3))
                }
                Deleted::Absent => {
                    eprintln!("idempotent-admin: no record for that scope and key");
                    Ok(ExitCode::from(2))
                }
                _ => Err("the store answered something this version does not know".into()),
            }
        }
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    match run(Args::parse()).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("idempotent-admin: {e}");
            ExitCode::FAILURE
        }
    }
}
