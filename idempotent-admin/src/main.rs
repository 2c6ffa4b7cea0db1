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
    /// The idempotency key, as the client sent it (with `--function`: the message id, byte for
    /// byte).
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
        // A function's key is its message id as it is (opaque); a route's is a header's value.
        let key = match &self.function {
            Some(_) => IdempotencyKey::opaque(self.key.as_str()),
            None => IdempotencyKey::parse(self.key.as_bytes()),
        }
        .map_err(|e| format!("--key: {e}"))?;
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

/// The database URL as errors print it: its scheme and its hosts with their ports, never its
/// user, password, path or query (a password may sit in any of them: `user:pw@`,
/// `?password=…`). A SQLite URL names a file, not a server: its path is shown, without the
/// query. `None` when `url` is no `scheme://…` URL (then none of it is shown).
///
/// ```text
/// postgres://app:s3cret@db.internal:5432/app?sslmode=require  →  postgres://db.internal:5432
/// redis+cluster://:pw@10.0.0.1:7000,10.0.0.2:7000             →  redis+cluster://10.0.0.1:7000,10.0.0.2:7000
/// sqlite://charges.db?mode=ro                                  →  sqlite://charges.db
/// ```
fn redacted(url: &str) -> Option<String> {
    let (scheme, rest) = url.split_once(':')?;
    if !is_scheme(scheme) {
        return None;
    }
    if scheme == "sqlite" {
        let path = rest.split(['?', '#']).next().unwrap_or_default();
        return Some(format!("{scheme}:{path}"));
    }
    let rest = rest.strip_prefix("//")?;
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    // A cluster URL lists several nodes; each may carry `user:password@`.
    let hosts: Vec<&str> = authority
        .split(',')
        .map(|node| node.rsplit_once('@').map_or(node, |(_, host)| host))
        .collect();
    Some(format!("{scheme}://{}", hosts.join(",")))
}

/// [`redacted`], or words that say the value is no URL.
fn shown(url: &str) -> String {
    redacted(url).unwrap_or_else(|| "the database (not a `scheme://…` URL)".into())
}

/// Whether `s` can be a URL scheme (RFC 3986: a letter, then letters, digits, `+`, `-`, `.`).
fn is_scheme(s: &str) -> bool {
    s.starts_with(|c: char| c.is_ascii_alphabetic())
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
}

/// `message` with `url`, and any password it carries, replaced: a driver's error may quote
/// the URL it was given or a part of it.
fn scrubbed(message: impl std::fmt::Display, url: &str) -> String {
    let mut message = message.to_string().replace(url, &shown(url));
    for secret in secrets(url) {
        message = message.replace(&secret, "***");
    }
    message
}

/// The passwords in `url`: after the user in `user:password@` (of each cluster node) and the
/// values of `password`-like query parameters, as written and percent-decoded.
fn secrets(url: &str) -> Vec<String> {
    let mut out = Vec::new();
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let (before_query, query) = rest.split_once('?').unwrap_or((rest, ""));
    let authority = before_query.split(['/', '#']).next().unwrap_or_default();
    for node in authority.split(',') {
        if let Some((userinfo, _)) = node.rsplit_once('@')
            && let Some((_, password)) = userinfo.split_once(':')
        {
            out.push(password.to_owned());
        }
    }
    for pair in query.split(['&', ';']) {
        if let Some((name, value)) = pair.split_once('=')
            && ["password", "pass", "pwd", "sslpassword"]
                .iter()
                .any(|n| name.eq_ignore_ascii_case(n))
        {
            out.push(value.to_owned());
        }
    }
    let decoded: Vec<String> = out.iter().filter_map(|s| percent_decoded(s)).collect();
    out.extend(decoded);
    // A short password would blank out unrelated text; it is still never printed as part of
    // the URL, which is replaced whole.
    out.retain(|s| s.len() >= 4);
    out
}

/// `s` percent-decoded, if it holds an escape and decodes to UTF-8.
fn percent_decoded(s: &str) -> Option<String> {
    if !s.contains('%') {
        return None;
    }
    let digit = |b: Option<&u8>| b.and_then(|&b| char::from(b).to_digit(16));
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        match (b, digit(bytes.get(i + 1)), digit(bytes.get(i + 2))) {
            (b'%', Some(high), Some(low)) => {
                // Two hex digits: at most 255.
                out.push(u8::try_from(high * 16 + low).ok()?);
                i += 3;
            }
            _ => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

/// Opens the store at `url`. Every error names the database by [`redacted`] only.
async fn open(url: &str, prefix: &str) -> Result<Box<dyn Store>, String> {
    let shown = shown(url);
    let failed = |e: &dyn std::fmt::Display| format!("cannot open {shown}: {}", scrubbed(e, url));
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
            .map_err(|e| failed(&e))?;
        return Ok(Box::new(store));
    }
    if url.starts_with("sqlite:") {
        // Never create a database: a mistyped path is an error, not a new empty file.
        let options = sqlx::sqlite::SqliteConnectOptions::from_str(url)
            .map_err(|e| failed(&e))?
            .create_if_missing(false);
        if options.get_filename() == std::path::Path::new(":memory:") {
            return Err("an in-memory SQLite database holds no records to inspect".into());
        }
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(options)
            .await
            .map_err(|e| failed(&e))?;
        let store = SqliteStore::builder(pool).build().map_err(|e| failed(&e))?;
        return Ok(Box::new(store));
    }
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect(url)
            .await
            .map_err(|e| failed(&e))?;
        return Ok(Box::new(PostgresStore::new(pool).map_err(|e| failed(&e))?));
    }
    if url.starts_with("mysql://") || url.starts_with("mariadb://") {
        let pool = sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(1)
            .connect(url)
            .await
            .map_err(|e| failed(&e))?;
        return Ok(Box::new(MySqlStore::new(pool).map_err(|e| failed(&e))?));
    }
    Err(format!(
        "cannot open {shown}: unsupported database URL; use sqlite://FILE, postgres://…, mysql://…, redis://… or redis+cluster://…"
    ))
}

async fn run(args: Args) -> Result<ExitCode, String> {
    let url = args
        .database
        .or_else(|| std::env::var("DATABASE_URL").ok())
        .ok_or("give --database URL (or set DATABASE_URL)")?;
    let store = open(&url, &args.prefix).await?;
    let failed = |e: idempotent_core::StoreError| scrubbed(e, &url);
    let print = |v: Value| println!("{v}");
    match args.command {
        Command::Get { record, show_body } => {
            let key = record.record_key()?;
            match store.get(&key).await.map_err(failed)? {
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
            match store.delete(&key, force).await.map_err(failed)? {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn which(function: Option<&str>, key: &str) -> Which {
        Which {
            scope: Some("acct_1".into()),
            unscoped: false,
            key: key.into(),
            function: function.map(Into::into),
        }
    }

    #[test]
    fn a_functions_key_is_taken_as_it_is() {
        let key = |w: Which| w.record_key().map(|k| k.key.as_str().to_owned());
        assert_eq!(key(which(Some("book"), " m1")), Ok(" m1".into()));
        assert_eq!(key(which(Some("book"), "\"m1\"")), Ok("\"m1\"".into()));
        // A route's key is read as the header was.
        assert_eq!(key(which(None, "\"m1\"")), Ok("m1".into()));
    }

    #[test]
    fn urls_lose_their_credentials() {
        for (url, shown) in [
            (
                "postgres://app:s3cret@db.internal:5432/app?sslmode=require",
                Some("postgres://db.internal:5432"),
            ),
            (
                "redis+cluster://:pw@10.0.0.1:7000,u:pw@10.0.0.2:7000",
                Some("redis+cluster://10.0.0.1:7000,10.0.0.2:7000"),
            ),
            ("mysql://root@[::1]:3306/app", Some("mysql://[::1]:3306")),
            ("sqlite://charges.db?mode=ro", Some("sqlite://charges.db")),
            ("sqlite:charges.db", Some("sqlite:charges.db")),
            ("user:pw@host", None),
            ("no url", None),
        ] {
            assert_eq!(redacted(url).as_deref(), shown, "{url}");
        }
        let url = "postgres://app:p%40ss-word@db/app?password=other-secret";
        let said = scrubbed(format!("failed: {url}, p@ss-word, other-secret"), url);
        assert_eq!(said, "failed: postgres://db, ***, ***");
    }
}
