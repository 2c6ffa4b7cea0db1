//! `idempotent-admin` as a real process against the records of an application (an Axum
//! route under `#[idempotent]`, served by this test, on SQLite, PostgreSQL, MySQL and Redis
//! Cluster): `get` shows a
//! finished record (state, status, fingerprint, times) without its body unless asked;
//! `delete` refuses an in-progress record without `--force` and deletes it with it (the
//! running execution's record is then refused by the fence); a deleted key runs again; an
//! unknown key is exit code 2.
#![allow(clippy::unwrap_used)] // tests unwrap freely

use axum::Router;
use axum::extract::{FromRequestParts, State};
use axum::http::{StatusCode, request::Parts};
use axum::routing::post;
use idempotent_axum::{
    Engine, Idempotency, MySqlStore, PostgresStore, SqliteStore, Store, idempotent,
};
use serde_json::Value;
use std::process::Command;
use std::time::Duration;

/// Runs the admin binary; its exit code and stdout as JSON (`Null` when empty).
fn admin(database: &str, args: &[&str]) -> (i32, Value, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_idempotent-admin"))
        .args(["--database", database])
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8(out.stdout).unwrap();
    let json = if stdout.trim().is_empty() {
        Value::Null
    } else {
        serde_json::from_str(stdout.trim()).unwrap()
    };
    (
        out.status.code().unwrap(),
        json,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The caller, from `Authorization: Bearer <account>`: the records' scope.
struct Account(String);

impl<S: Send + Sync> FromRequestParts<S> for Account {
    type Rejection = StatusCode;
    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, StatusCode> {
        parts
            .headers
            .get("authorization")
            .and_then(|v| v.to_str().ok()?.strip_prefix("Bearer "))
            .map(|account| Account(account.to_owned()))
            .ok_or(StatusCode::UNAUTHORIZED)
    }
}

/// A charge: answers 201 with the body it was sent, after the server's work delay.
#[idempotent(scope = "account")]
async fn create_charge(
    State(work): State<Duration>,
    Account(account): Account,
    body: String,
) -> (StatusCode, String) {
    tokio::time::sleep(work).await;
    (
        StatusCode::CREATED,
        format!(r#"{{"account": "{account}", "charge": {body}}}"#),
    )
}

/// A server on a free port whose charges take `work`, on the database's store (migrated),
/// with a 2 s lease (heartbeat-extended while a charge runs); its base URL. It runs until the
/// test ends.
async fn serve(database: &str, work: Duration) -> String {
    let idempotency = if database.starts_with("redis") {
        configure(
            idempotent_axum::RedisStore::connect(database)
                .await
                .unwrap(),
        )
    } else if database.starts_with("sqlite:") {
        let store = SqliteStore::connect(database).await.unwrap();
        store.migrate().await.unwrap();
        configure(store)
    } else if database.starts_with("mysql:") || database.starts_with("mariadb:") {
        let pool = idempotent_axum::sqlx::mysql::MySqlPoolOptions::new()
            .test_before_acquire(false)
            .connect(database)
            .await
            .unwrap();
        let store = MySqlStore::new(pool).unwrap();
        store.migrate().await.unwrap();
        configure(store)
    } else {
        let pool = idempotent_axum::sqlx::PgPool::connect(database)
            .await
            .unwrap();
        let store = PostgresStore::new(pool).unwrap();
        store.migrate().await.unwrap();
        configure(store)
    };
    let app = Router::new()
        .route("/v1/charges", post(create_charge))
        .layer(idempotency.layer())
        .with_state(work);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    base
}

fn configure(store: impl Store) -> Idempotency {
    let engine = Engine::builder(store)
        .lease(Duration::from_secs(2))
        .build()
        .unwrap();
    Idempotency::builder_from_engine(engine).build().unwrap()
}

fn charge(base: &str, account: &str, key: &str) -> reqwest::RequestBuilder {
    reqwest::Client::new()
        .post(format!("{base}/v1/charges"))
        .bearer_auth(account)
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(r#"{"amount": 700, "currency": "usd", "customer": "cus_admin"}"#)
}

async fn inspect_and_delete(database: &str) {
    let account = format!("acct_adm_{}", uuid::Uuid::new_v4().simple());
    let key = uuid::Uuid::new_v4().to_string();
    let server = serve(database, Duration::ZERO).await;
    let first = charge(&server, &account, &key).send().await.unwrap();
    assert_eq!(first.status(), 201);
    let which = ["--scope", account.as_str(), "--key", key.as_str()];

    let (code, record, _) = admin(database, &[&["get"][..], &which].concat());
    assert_eq!(code, 0);
    assert_eq!(record["state"], "done");
    assert_eq!(record["status"], 201);
    assert_eq!(record["scope"], account.as_str());
    assert_eq!(record["key"], key.as_str());
    assert_eq!(
        record["fingerprint"].as_str().unwrap().len(),
        64,
        "{record}"
    );
    assert!(record["fingerprint_version"].as_u64().is_some(), "{record}");
    assert!(record["expires"].as_f64().unwrap() > record["created"].as_f64().unwrap());
    assert!(
        record.get("body").is_none(),
        "the body only with --show-body"
    );
    assert!(record["body_bytes"].as_u64().unwrap() > 0);
    let (_, with_body, _) = admin(database, &[&["get", "--show-body"][..], &which].concat());
    assert!(with_body["body"].as_str().unwrap().contains("cus_admin"));

    // Deleted: the key is new again, and the same request runs again (a second charge).
    let (code, gone, _) = admin(database, &[&["delete"][..], &which].concat());
    assert_eq!((code, gone["deleted"].as_bool()), (0, Some(true)));
    let (code, _, said) = admin(database, &[&["get"][..], &which].concat());
    assert_eq!(code, 2, "{said}");
    let again = charge(&server, &account, &key).send().await.unwrap();
    assert_eq!(again.headers()["idempotent-replayed"], "false");

    // In progress. Plain mode: the claim is committed and no transaction is open while the
    // handler runs (a transactional handler on SQLite would hold the write lock the delete
    // waits for).
    let slow = serve(database, Duration::from_secs(6)).await;
    let running_key = uuid::Uuid::new_v4().to_string();
    let pending = tokio::spawn(charge(&slow, &account, &running_key).send());
    let running = ["--scope", account.as_str(), "--key", running_key.as_str()];
    // Until the claim is there (the handler then runs 6 s).
    for _ in 0..50 {
        if admin(database, &[&["get"][..], &running].concat()).0 == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (code, record, said) = admin(database, &[&["delete"][..], &running].concat());
    assert_eq!(code, 3, "{said}");
    assert!(said.contains("--force"), "{said}");
    assert_eq!(record["state"], "in_progress");
    let (code, record, _) = admin(database, &[&["get"][..], &running].concat());
    assert_eq!((code, record["state"].as_str()), (0, Some("in_progress")));
    let (code, gone, _) = admin(database, &[&["delete", "--force"][..], &running].concat());
    assert_eq!((code, gone["state"].as_str()), (0, Some("in_progress")));
    // The first execution ran on (plain mode: its charge is written and its client told so),
    // but the fence refused its record: nothing is stored under the key, so a retry would run
    // again. That is what `--force` risks.
    let late = pending.await.unwrap().unwrap();
    assert_eq!(late.status(), 201);
    let (code, _, _) = admin(database, &[&["get"][..], &running].concat());
    assert_eq!(code, 2);

    // Bad input: a clear message, exit code 1.
    let (code, _, said) = admin(database, &["get", "--scope", "", "--key", "k"]);
    assert_eq!(code, 1);
    assert!(said.contains("--scope"), "{said}");
    let (code, _, said) = admin(database, &["get", "--unscoped", "--key", "a b"]);
    assert_eq!(code, 1);
    assert!(said.contains("--key"), "{said}");
    let (code, _, said) = admin(database, &["get", "--unscoped", "--key", "no-such-key"]);
    assert_eq!(code, 2, "{said}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_on_sqlite() {
    // A path with no database is an error, and creates none.
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.db");
    let url = format!("sqlite://{}", missing.display());
    let (code, _, said) = admin(&url, &["get", "--scope", "a", "--key", "k"]);
    assert_eq!(code, 1);
    assert!(said.contains("cannot open"), "{said}");
    assert!(!missing.exists());
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("charges.db").display());
    inspect_and_delete(&url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(pg),
    ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
)]
async fn admin_on_postgres() {
    inspect_and_delete(&std::env::var("DATABASE_URL").unwrap()).await;
}

/// On a database of its own (`idem_<uuid>` on `MYSQL_URL`'s server), dropped at the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(mysql_db),
    ignore = "set MYSQL_URL=mysql://… to run the MySQL tests"
)]
async fn admin_on_mysql() {
    let server = std::env::var("MYSQL_URL").unwrap();
    let name = format!("idem_{}", uuid::Uuid::new_v4().simple());
    mysql_admin(&server, &format!("CREATE DATABASE {name}")).await;
    let (address, query) = server.split_once('?').unwrap_or((server.as_str(), ""));
    let authority = address.find("://").map_or(0, |at| at + 3);
    let host_end = address[authority..]
        .find('/')
        .map_or(address.len(), |at| authority + at);
    let url = match query {
        "" => format!("{}/{name}", &address[..host_end]),
        query => format!("{}/{name}?{query}", &address[..host_end]),
    };
    let tested = tokio::spawn(async move {
        inspect_and_delete(&url).await;
        // `mariadb://` names the same server (sqlx takes both schemes): no such record.
        let mariadb = url.replacen("mysql://", "mariadb://", 1);
        let (code, _, said) = admin(&mariadb, &["get", "--scope", "a", "--key", "k"]);
        assert_eq!(code, 2, "{said}");
    })
    .await;
    mysql_admin(&server, &format!("DROP DATABASE {name}")).await;
    if let Err(e) = tested {
        std::panic::resume_unwind(e.into_panic());
    }
}

/// Runs one statement on a connection of its own to `server`.
async fn mysql_admin(server: &str, sql: &str) {
    use idempotent_axum::sqlx::{self, Connection};
    let mut conn = sqlx::MySqlConnection::connect(server).await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
        .execute(&mut conn)
        .await
        .unwrap();
    let _ = conn.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(redis_cluster),
    ignore = "set REDIS_CLUSTER_URL=redis+cluster://host:port,… to run the Redis Cluster tests"
)]
async fn admin_on_redis_cluster() {
    inspect_and_delete(&std::env::var("REDIS_CLUSTER_URL").unwrap()).await;
}

/// A database URL is printed as its scheme, host and port only: never its user, password,
/// path or query (`?password=…`), whatever fails (an unreachable server, a URL the tool does
/// not take, one it cannot parse). A SQLite URL shows its file's path.
#[test]
fn errors_print_database_urls_without_credentials() {
    let secret = "s3cr3t-pw";
    let cases = [
        // Nothing listens on port 1: the connection fails.
        (
            format!("redis://default:{secret}@127.0.0.1:1/0"),
            "redis://127.0.0.1:1",
        ),
        (
            format!("redis+cluster://user:{secret}@127.0.0.1:1,127.0.0.1:2"),
            "redis+cluster://127.0.0.1:1,127.0.0.1:2",
        ),
        // Not a scheme the tool takes.
        (
            format!("mongodb://admin:{secret}@db.internal:27017/app?authSource=admin"),
            "mongodb://db.internal:27017",
        ),
        // Refused while its options are read, before any connection.
        (
            format!("postgres://admin:{secret}@db.internal:notaport/app?password={secret}"),
            "postgres://db.internal:notaport",
        ),
        (
            format!("mysql://root:{secret}@db.internal:notaport/app"),
            "mysql://db.internal:notaport",
        ),
        // A SQLite URL names a file, not a server: its path is shown, not its query.
        (
            format!("sqlite://no-such-dir/charges.db?password={secret}"),
            "sqlite://no-such-dir/charges.db",
        ),
        // Not a URL at all: none of it is shown.
        (format!("{secret}@db.internal"), "not a `scheme://…` URL"),
    ];
    for (url, shown) in cases {
        let (code, _, said) = admin(&url, &["get", "--scope", "a", "--key", "k"]);
        assert_eq!(code, 1, "{url}: {said}");
        assert!(!said.contains(secret), "{url} printed its secret: {said}");
        assert!(said.contains(shown), "{url}: expected `{shown}` in: {said}");
    }
}
