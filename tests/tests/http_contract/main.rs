//! The HTTP contract, written once and run against an Axum server and an Actix-web server
//! exposing the same routes (`axum_app`, `actix_app`), on the memory, SQLite, PostgreSQL,
//! MySQL (MariaDB) and Redis (standalone and cluster) stores, through real servers on
//! 127.0.0.1 with a real HTTP client (and raw TCP where the
//! framing itself is under test): every row of DESIGN.md §1's table, the exactly-once cases
//! (client timeouts and disconnects, path parameters, streamed responses) and the failure
//! modes. A difference between the two frameworks on the wire is a bug; `wire_parity` compares
//! them byte for byte where the library writes the response.
#![allow(clippy::unwrap_used)] // tests unwrap freely

mod actix_app;
mod axum_app;
mod hostile;

use hostile::{
    function_namespaces_are_no_caller_identity, hostile_json_is_fingerprinted_without_harm,
    hostile_keys_are_400_and_claim_nothing, one_caller_cannot_fill_the_memory_store,
    scope_and_key_values_never_collide, slow_bodies_time_out_and_claim_nothing,
    thousands_of_headers_are_refused_cleanly,
};

use idempotent_core::http::{Config, ConfigBuilder, ConfigError};
use idempotent_core::{Engine, MemoryStore, Store};
use idempotent_tests::faults::FaultyStore;
use serde_json::Value;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The handlers' shared state: how often they ran, and the gate of `/stream/gate`.
#[derive(Clone, Default)]
pub(crate) struct App {
    pub(crate) runs: Arc<AtomicUsize>,
    pub(crate) panicked_once: Arc<AtomicBool>,
    /// Releases the second half of `/stream/gate`.
    pub(crate) gate: Arc<tokio::sync::Notify>,
    /// What the transactional routes (`/tx/sqlite`, `/tx/postgres`, `/tx/mysql`) write and
    /// report.
    pub(crate) tx: Arc<TxHooks>,
}

/// The transactional routes' business table, the PostgreSQL backend of the last handler (for
/// the fault test), and how long a handler holds its transaction after writing.
#[derive(Default)]
pub(crate) struct TxHooks {
    pub(crate) table: std::sync::Mutex<String>,
    pub(crate) pid: std::sync::Mutex<Option<i32>>,
    /// The MySQL connection id of the last handler, for the fault test.
    pub(crate) mysql_id: std::sync::Mutex<Option<i64>>,
    pub(crate) hold_ms: std::sync::atomic::AtomicU64,
}

/// The transactional handlers' write (both frameworks): one row through the transaction. The
/// status comes from the request's `{"status": …}`.
pub(crate) async fn tx_work<DB: idempotent_core::tx::TxDatabase>(
    app: &App,
    tx: &mut idempotent_core::Transaction<DB>,
) where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    app.runs.fetch_add(1, Ordering::SeqCst);
    let table = app.tx.table.lock().unwrap().clone();
    let sql = format!(
        "INSERT INTO {table} (id) VALUES ('{}')",
        uuid::Uuid::new_v4().simple()
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .execute(&mut **tx)
        .await
        .unwrap();
}

/// Holds the transaction open after the write, as long as the test set.
pub(crate) async fn tx_hold(app: &App) {
    let hold = app.tx.hold_ms.load(Ordering::SeqCst);
    if hold > 0 {
        tokio::time::sleep(Duration::from_millis(hold)).await;
    }
}

/// Records the handler's PostgreSQL backend, for the fault test.
pub(crate) async fn tx_record_pid(
    app: &App,
    tx: &mut idempotent_core::Transaction<sqlx::Postgres>,
) {
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut **tx)
        .await
        .unwrap();
    *app.tx.pid.lock().unwrap() = Some(pid);
}

/// Records the handler's MySQL connection id, for the fault test.
pub(crate) async fn tx_record_mysql_id(
    app: &App,
    tx: &mut idempotent_core::Transaction<sqlx::MySql>,
) {
    let id: i64 = sqlx::query_scalar("SELECT CAST(CONNECTION_ID() AS SIGNED)")
        .fetch_one(&mut **tx)
        .await
        .unwrap();
    *app.tx.mysql_id.lock().unwrap() = Some(id);
}

/// Which framework serves the routes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fw {
    Axum,
    Actix,
}

struct Server {
    base: String,
    addr: SocketAddr,
    app: App,
    engine: Engine,
    client: reqwest::Client,
}

/// A configuration over `store` whose request limit is 1 KiB.
fn limited(store: impl Store) -> Config {
    ConfigBuilder::<Config>::new(Engine::new(store))
        .max_request(1024)
        .build()
        .unwrap()
}

/// The default configuration over `store`.
fn config(store: impl Store) -> Config {
    Config::new(Engine::new(store))
}

/// The routes served by `fw` under `config`, with the middleware.
async fn serve(fw: Fw, config: Config) -> Server {
    serve_wired(fw, config, true).await
}

async fn serve_wired(fw: Fw, config: Config, wired: bool) -> Server {
    let app = App::default();
    let engine = config.engine().clone();
    let addr = match fw {
        Fw::Axum => axum_app::serve(config, &app, wired).await,
        Fw::Actix => actix_app::serve(config, &app, wired),
    };
    Server {
        base: format!("http://{addr}"),
        addr,
        app,
        engine,
        client: reqwest::Client::new(),
    }
}

impl Server {
    fn runs(&self) -> usize {
        self.app.runs.load(Ordering::SeqCst)
    }
    fn post(
        &self,
        path: &str,
        account: &str,
        key: Option<&str>,
        body: &str,
    ) -> reqwest::RequestBuilder {
        let mut r = self
            .client
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(body.to_owned());
        if !account.is_empty() {
            r = r.header("authorization", format!("Bearer {account}"));
        }
        if let Some(k) = key {
            r = r.header("idempotency-key", k);
        }
        r
    }
    fn raw_post(
        &self,
        path: &str,
        key: &str,
        content_type: &str,
        body: &str,
    ) -> reqwest::RequestBuilder {
        self.client
            .post(format!("{}{path}", self.base))
            .header("idempotency-key", key)
            .header("content-type", content_type)
            .body(body.to_owned())
    }
    /// Retries while the answer is 409 (in progress), as a client following `Retry-After`
    /// would, but faster.
    async fn until_not_busy(&self, req: impl Fn() -> reqwest::RequestBuilder) -> reqwest::Response {
        for _ in 0..200 {
            let res = req().send().await.unwrap();
            if res.status() != 409 {
                return res;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("still in progress after 5 s");
    }
}

fn key() -> String {
    format!("k-{}", uuid::Uuid::new_v4())
}

async fn problem(res: reqwest::Response, status: u16, slug: &str) -> Value {
    assert_eq!(res.status().as_u16(), status);
    assert_eq!(res.headers()["content-type"], "application/problem+json");
    assert_eq!(res.headers()["cache-control"], "no-store");
    let body: Value = res.json().await.unwrap();
    assert_eq!(
        body["type"],
        format!("https://docs.rs/idempotent-core/0.1/idempotent_core/struct.Problem.html#{slug}"),
        "{body}"
    );
    assert_eq!(body["status"], status);
    assert!(
        body["title"].is_string() && body["detail"].is_string(),
        "{body}"
    );
    body
}

async fn contract(fw: Fw, config: Config) {
    let s = serve(fw, config).await;
    let key = key();

    // First request: runs once, stored, marked not replayed.
    let first = s
        .post("/v1/charges", "acct_a", Some(&key), r#"{"amount": 100}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), 201);
    assert_eq!(first.headers()["idempotent-replayed"], "false");
    let first_body = first.bytes().await.unwrap();
    assert_eq!(s.runs(), 1);

    // Retry (keys reordered, spaced; quoted sf-string key): the stored response, replayed.
    let quoted = format!("\"{key}\"");
    let retry = s
        .post(
            "/v1/charges",
            "acct_a",
            Some(&quoted),
            "{ \"amount\" : 100 }",
        )
        .send()
        .await
        .unwrap();
    assert_eq!(retry.status(), 201);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    let traces: Vec<_> = retry
        .headers()
        .get_all("x-trace")
        .iter()
        .map(|v| v.to_str().unwrap().to_owned())
        .collect();
    assert_eq!(traces, ["a1", "b1"], "repeated headers kept in order");
    assert_eq!(retry.headers()["content-type"], "application/json");
    assert_eq!(retry.bytes().await.unwrap(), first_body, "same body bytes");
    assert_eq!(s.runs(), 1, "the handler did not run again");

    // Same key, different body: 422; same key on another route: 422.
    let other = s
        .post("/v1/charges", "acct_a", Some(&key), r#"{"amount": 101}"#)
        .send()
        .await
        .unwrap();
    problem(other, 422, "idempotency-key-mismatch").await;
    let route = s
        .post("/v1/refunds", "acct_a", Some(&key), r#"{"amount": 100}"#)
        .send()
        .await
        .unwrap();
    problem(route, 422, "idempotency-key-mismatch").await;

    // Same key, another account: its own execution.
    let b = s
        .post("/v1/charges", "acct_b", Some(&key), r#"{"amount": 100}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(b.status(), 201);
    assert_eq!(b.headers()["idempotent-replayed"], "false");
    assert_eq!(s.runs(), 2);

    // Missing and malformed keys: 400, nothing runs.
    problem(
        s.post("/v1/charges", "acct_a", None, r#"{"amount": 1}"#)
            .send()
            .await
            .unwrap(),
        400,
        "idempotency-key-missing",
    )
    .await;
    let long = "x".repeat(256);
    for bad in ["", "\"unterminated", long.as_str(), "has space"] {
        let res = s
            .post("/v1/charges", "acct_a", Some(bad), r#"{"amount": 1}"#)
            .send()
            .await
            .unwrap();
        problem(res, 400, "idempotency-key-invalid").await;
    }
    let two = s
        .post("/v1/charges", "acct_a", Some("one"), r#"{"amount": 1}"#)
        .header("idempotency-key", "two")
        .send()
        .await
        .unwrap();
    problem(two, 400, "idempotency-key-invalid").await;
    let nonascii = s
        .post("/v1/charges", "acct_a", None, r#"{"amount": 1}"#)
        .header(
            "idempotency-key",
            reqwest::header::HeaderValue::from_bytes(b"caf\xe9").unwrap(),
        )
        .send()
        .await
        .unwrap();
    problem(nonascii, 400, "idempotency-key-invalid").await;
    assert_eq!(s.runs(), 2);

    // Safe methods ignore the key, even a malformed one.
    let list = s
        .client
        .get(format!("{}/v1/charges", s.base))
        .header("idempotency-key", "\"not closed")
        .send()
        .await
        .unwrap();
    assert_eq!(list.status(), 200);
    assert_eq!(list.text().await.unwrap(), "runs=2");

    // Extractor rejections happen before the claim: a corrected retry with the same key runs.
    let k2 = self::key();
    let bad_json = s
        .post("/v1/charges", "acct_a", Some(&k2), r#"{"amount": "#)
        .send()
        .await
        .unwrap();
    assert!(bad_json.status().is_client_error());
    let no_auth = s
        .post("/v1/charges", "", Some(&k2), r#"{"amount": 5}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(no_auth.status(), 401);
    let fixed = s
        .post("/v1/charges", "acct_a", Some(&k2), r#"{"amount": 5}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(fixed.status(), 201);
    assert_eq!(s.runs(), 3);

    // A 5xx releases the key: the retry runs again.
    let k3 = self::key();
    for _ in 0..2 {
        let res = s
            .post("/v1/charges", "acct_a", Some(&k3), r#"{"amount": 500}"#)
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 502);
    }
    assert_eq!(s.runs(), 5);

    // A panicking handler releases the key: the retry runs (and succeeds this time).
    let k4 = self::key();
    let boom = s
        .post("/v1/charges", "acct_a", Some(&k4), r#"{"amount": 13}"#)
        .send()
        .await;
    assert!(boom.is_err() || boom.unwrap().status().is_server_error());
    let after = s
        .until_not_busy(|| s.post("/v1/charges", "acct_a", Some(&k4), r#"{"amount": 13}"#))
        .await;
    assert_eq!(after.status(), 201);
    assert_eq!(after.headers()["idempotent-replayed"], "false");
    assert_eq!(s.runs(), 7);

    // 32 concurrent identical requests against a slow handler: one execution; the others
    // get 409 with Retry-After, or the replay.
    let k5 = self::key();
    let before = s.runs();
    let requests: Vec<_> = (0..32)
        .map(|_| {
            s.post("/v1/charges", "acct_a", Some(&k5), r#"{"amount": 7}"#)
                .send()
        })
        .collect();
    let responses = futures_util::future::join_all(requests).await;
    let (mut created, mut busy) = (0, 0);
    for res in responses {
        let res = res.unwrap();
        match res.status().as_u16() {
            201 => created += 1,
            409 => {
                assert!(
                    res.headers()["retry-after"]
                        .to_str()
                        .unwrap()
                        .parse::<u64>()
                        .unwrap()
                        >= 1
                );
                problem(res, 409, "idempotency-key-in-progress").await;
                busy += 1;
            }
            other => panic!("unexpected {other}"),
        }
    }
    assert_eq!(created + busy, 32);
    assert!(created >= 1);
    assert_eq!(s.runs() - before, 1, "exactly one execution");

    client_timeout_then_retry(&s).await;
    path_parameters_are_part_of_the_request(&s).await;
    form_bodies(&s).await;
    streamed_responses(&s).await;
}

/// The headline case: the client times out while the handler runs, then retries. The work
/// runs once: the retry gets 409 while it runs, then the stored response.
async fn client_timeout_then_retry(s: &Server) {
    let k = key();
    let before = s.runs();
    let gone = s
        .post("/v1/charges", "acct_a", Some(&k), r#"{"amount": 7}"#)
        .timeout(Duration::from_millis(300))
        .send()
        .await;
    let err = gone.expect_err("the client gave up");
    assert!(err.is_timeout(), "the client timed out: {err}");
    // The handler (1.5 s) is still running on the server.
    let busy = s
        .post("/v1/charges", "acct_a", Some(&k), r#"{"amount": 7}"#)
        .send()
        .await
        .unwrap();
    assert!(
        busy.headers()["retry-after"]
            .to_str()
            .unwrap()
            .parse::<u64>()
            .unwrap()
            >= 1
    );
    problem(busy, 409, "idempotency-key-in-progress").await;
    let done = s
        .until_not_busy(|| s.post("/v1/charges", "acct_a", Some(&k), r#"{"amount": 7}"#))
        .await;
    assert_eq!(done.status(), 201);
    assert_eq!(done.headers()["idempotent-replayed"], "true");
    let body: Value = done.json().await.unwrap();
    assert_eq!(body["id"], format!("ch_{}", before + 1));
    assert_eq!(s.runs() - before, 1, "the work happened once");
}

async fn path_parameters_are_part_of_the_request(s: &Server) {
    let k = key();
    let before = s.runs();
    let one = s
        .post("/orders/1/refund", "acct_a", Some(&k), "")
        .send()
        .await
        .unwrap();
    assert_eq!(one.status(), 201);
    let one_body = one.text().await.unwrap();
    assert!(one_body.contains("of order 1"), "{one_body}");
    // Another order under the same key: a different operation, never order 1's replay.
    let two = s
        .post("/orders/2/refund", "acct_a", Some(&k), "")
        .send()
        .await
        .unwrap();
    problem(two, 422, "idempotency-key-mismatch").await;
    // The same path as received, percent-encoded or under a nested router's prefix, is
    // another request too (no normalisation).
    let encoded = s
        .post("/orders/%31/refund", "acct_a", Some(&k), "")
        .send()
        .await
        .unwrap();
    problem(encoded, 422, "idempotency-key-mismatch").await;
    let nested = s
        .post("/v2/orders/1/refund", "acct_a", Some(&k), "")
        .send()
        .await
        .unwrap();
    problem(nested, 422, "idempotency-key-mismatch").await;
    // The same path replays; a query string is part of the request.
    let again = s
        .post("/orders/1/refund", "acct_a", Some(&k), "")
        .send()
        .await
        .unwrap();
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.text().await.unwrap(), one_body);
    let query = s
        .post("/orders/1/refund?reason=dup", "acct_a", Some(&k), "")
        .send()
        .await
        .unwrap();
    problem(query, 422, "idempotency-key-mismatch").await;
    // Nested routes keep their prefix in the fingerprint and still replay.
    let k2 = key();
    let first = s
        .post("/v2/orders/9/refund", "acct_a", Some(&k2), "")
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), 201);
    let replay = s
        .post("/v2/orders/9/refund", "acct_a", Some(&k2), "")
        .send()
        .await
        .unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(s.runs() - before, 2);
}

async fn form_bodies(s: &Server) {
    let form = "application/x-www-form-urlencoded";
    let before = s.runs();
    let k = key();
    let first = s
        .raw_post("/echo", &k, form, "amount=1&amount=100&currency=usd")
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), 200);
    // Field order does not matter ...
    let moved = s
        .raw_post("/echo", &k, form, "currency=usd&amount=1&amount=100")
        .send()
        .await
        .unwrap();
    assert_eq!(moved.headers()["idempotent-replayed"], "true");
    // ... the order of a repeated field's values does.
    let swapped = s
        .raw_post("/echo", &k, form, "amount=100&amount=1&currency=usd")
        .send()
        .await
        .unwrap();
    problem(swapped, 422, "idempotency-key-mismatch").await;
    assert_eq!(s.runs() - before, 1);
}

/// Whether the response broke off (or was a 409 while a release is pending): the client
/// sees a broken stream as a failed request or a failed body, depending on when it broke.
async fn broken_stream(req: reqwest::RequestBuilder) -> bool {
    match req.send().await {
        Err(_) => true,
        Ok(res) if res.status() == 409 => true,
        Ok(res) => res.bytes().await.is_err(),
    }
}

async fn streamed_responses(s: &Server) {
    let text = "text/plain";
    // Within the limit: streamed, stored, replayed byte for byte.
    let before = s.runs();
    let k = key();
    let first = s.raw_post("/stream/ok", &k, text, "").send().await.unwrap();
    assert_eq!(first.status(), 200);
    assert_eq!(first.headers()["idempotent-replayed"], "false");
    assert_eq!(first.text().await.unwrap(), "chunk-1;chunk-2;chunk-3");
    let replay = s
        .until_not_busy(|| s.raw_post("/stream/ok", &k, text, ""))
        .await;
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(replay.text().await.unwrap(), "chunk-1;chunk-2;chunk-3");
    assert_eq!(s.runs() - before, 1);

    // Over the limit: the client gets it all; the retry gets 410 and nothing runs again.
    let before = s.runs();
    let k = key();
    let big = s
        .raw_post("/stream/big", &k, text, "")
        .send()
        .await
        .unwrap();
    assert_eq!(big.text().await.unwrap().len(), 100);
    let gone = s
        .until_not_busy(|| s.raw_post("/stream/big", &k, text, ""))
        .await;
    problem(gone, 410, "idempotency-response-not-stored").await;
    assert_eq!(s.runs() - before, 1);

    // Fails before it could be stored: nothing stored, the key released, the retry runs.
    let before = s.runs();
    let k = key();
    assert!(broken_stream(s.raw_post("/stream/fails-early", &k, text, "")).await);
    for _ in 0..200 {
        if s.runs() - before == 2 {
            break;
        }
        // A 409 while the release is on its way; then the retry runs (and breaks) again.
        assert!(broken_stream(s.raw_post("/stream/fails-early", &k, text, "")).await);
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(s.runs() - before, 2, "released: the retry ran again");

    // Fails after the oversized marker: the marker stays (the handler ran).
    let before = s.runs();
    let k = key();
    assert!(broken_stream(s.raw_post("/stream/fails-late", &k, text, "")).await);
    let gone = s
        .until_not_busy(|| s.raw_post("/stream/fails-late", &k, text, ""))
        .await;
    problem(gone, 410, "idempotency-response-not-stored").await;
    assert_eq!(s.runs() - before, 1);

    // A slow stream is not held back: the first chunk arrives while the handler still waits.
    let before = s.runs();
    let k = key();
    let mut slow = s
        .raw_post("/stream/gate", &k, text, "")
        .send()
        .await
        .unwrap();
    let chunk = tokio::time::timeout(Duration::from_secs(5), slow.chunk())
        .await
        .expect("the first chunk came before the stream ended")
        .unwrap()
        .unwrap();
    assert_eq!(&chunk[..], b"first;");
    let busy = s
        .raw_post("/stream/gate", &k, text, "")
        .send()
        .await
        .unwrap();
    problem(busy, 409, "idempotency-key-in-progress").await;
    s.app.gate.notify_one();
    assert_eq!(slow.chunk().await.unwrap().unwrap(), "second");
    let replay = s
        .until_not_busy(|| s.raw_post("/stream/gate", &k, text, ""))
        .await;
    assert_eq!(replay.text().await.unwrap(), "first;second");

    // The client leaves mid-stream: the rest is read on the server and stored.
    let k = key();
    let mut left = s
        .raw_post("/stream/gate", &k, text, "")
        .send()
        .await
        .unwrap();
    assert_eq!(left.chunk().await.unwrap().unwrap(), "first;");
    drop(left);
    tokio::time::sleep(Duration::from_millis(100)).await;
    s.app.gate.notify_one();
    let replay = s
        .until_not_busy(|| s.raw_post("/stream/gate", &k, text, ""))
        .await;
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(replay.text().await.unwrap(), "first;second");
    assert_eq!(s.runs() - before, 2, "one run per key");
}

async fn contract_on_memory_store(fw: Fw) {
    contract(fw, config(MemoryStore::new())).await;
}

async fn contract_on_sqlite_store(fw: Fw) {
    let dir = tempfile::tempdir().unwrap();
    let store = idempotent_core::SqliteStore::connect(&format!(
        "sqlite://{}",
        dir.path().join("e2e.db").display()
    ))
    .await
    .unwrap();
    store.migrate().await.unwrap();
    contract(fw, config(store)).await;
}

async fn contract_on_postgres_store(fw: Fw) {
    let pool = idempotent_tests::fixtures::pg_pool(16).await;
    let table = idempotent_tests::fixtures::unique_table("e2e");
    let store = idempotent_tests::fixtures::pg_store(pool.clone(), &table).await;
    contract(fw, config(store)).await;
    idempotent_tests::fixtures::pg_drop(&pool, &table).await;
}

async fn contract_on_mysql_store(fw: Fw) {
    let pool = idempotent_tests::fixtures::mysql_pool(16).await;
    let table = idempotent_tests::fixtures::unique_table("e2e");
    let store = idempotent_tests::fixtures::mysql_store(pool.clone(), &table).await;
    contract(fw, config(store)).await;
    idempotent_tests::fixtures::mysql_drop(&pool, &table).await;
}

/// The contract on Redis; its transactional routes refuse (no transaction spans Redis and a
/// SQL database), and the automatic sweeper never starts (Redis expires records itself).
async fn contract_on_redis(fw: Fw, fixture: idempotent_tests::fixtures::Redis) {
    let config = config(fixture.store().await);
    let engine = config.engine().clone();
    contract(fw, config).await;
    assert!(
        !engine.sweeper_running(),
        "the sweeper started on a store that expires records itself"
    );
    let s = serve(fw, self::config(fixture.store().await)).await;
    refuses_the_wrong_database(&s, "/tx/postgres", "PostgreSQL").await;
    refuses_the_wrong_database(&s, "/tx/sqlite", "SQLite").await;
    refuses_the_wrong_database(&s, "/tx/mysql", "MySQL").await;
    idempotent_tests::Fixture::cleanup(&fixture).await;
}

async fn contract_on_redis_standalone(fw: Fw) {
    contract_on_redis(fw, idempotent_tests::fixtures::Redis::standalone()).await;
}

async fn contract_on_redis_cluster(fw: Fw) {
    contract_on_redis(fw, idempotent_tests::fixtures::Redis::cluster()).await;
}

/// Transactional routes on a store of their database: a stored response commits the row with
/// the record (then replays, nothing runs); a 5xx rolls it back and the retry runs again; a
/// 4xx is stored and commits its row. `rows` counts the business table outside any
/// transaction.
async fn tx_cycle<F, Fut>(s: &Server, path: &str, rows: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = i64>,
{
    let (runs, before) = (s.runs(), rows().await);
    let k = key();
    let first = s
        .post(path, "", Some(&k), r#"{"status": 201}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), 201);
    assert_eq!(first.headers()["idempotent-replayed"], "false");
    assert_eq!(rows().await, before + 1);
    let again = s
        .post(path, "", Some(&k), r#"{"status": 201}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(again.status(), 201);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!((s.runs() - runs, rows().await), (1, before + 1));
    let k = key();
    for n in 1..=2 {
        let failed = s
            .post(path, "", Some(&k), r#"{"status": 502}"#)
            .send()
            .await
            .unwrap();
        assert_eq!(failed.status(), 502, "the handler's own answer");
        assert!(!failed.headers().contains_key("idempotent-replayed"));
        assert_eq!(s.runs() - runs, 1 + n, "a 5xx releases: the retry runs");
        assert_eq!(rows().await, before + 1, "and its row rolled back");
    }
    let k = key();
    let refused = s
        .post(path, "", Some(&k), r#"{"status": 422}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 422);
    assert_eq!(rows().await, before + 2, "a stored 4xx commits its writes");
    let replay = s
        .post(path, "", Some(&k), r#"{"status": 422}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
}

/// A transactional route whose store is on another database (or the memory store) answers
/// 500 and never runs. The problem names no database product (the server's log does): the
/// client learns nothing of the server's wiring.
async fn refuses_the_wrong_database(s: &Server, path: &str, wanted: &str) {
    let runs = s.runs();
    let res = s
        .post(path, "", Some(&key()), r#"{"status": 201}"#)
        .send()
        .await
        .unwrap();
    let body = problem(res, 500, "idempotency-misconfigured").await;
    let text = body.to_string().to_ascii_lowercase();
    for product in [
        wanted, "postgres", "sqlite", "mysql", "mariadb", "memory", "redis", "database",
    ] {
        assert!(
            !text.contains(&product.to_ascii_lowercase()),
            "the problem names {product}: {body}"
        );
    }
    assert_eq!(s.runs(), runs);
}

async fn transactional_routes_on_memory_and_sqlite(fw: Fw) {
    let s = serve(fw, config(MemoryStore::new())).await;
    refuses_the_wrong_database(&s, "/tx/postgres", "PostgreSQL").await;
    refuses_the_wrong_database(&s, "/tx/sqlite", "SQLite").await;
    refuses_the_wrong_database(&s, "/tx/mysql", "MySQL").await;
    let dir = tempfile::tempdir().unwrap();
    let store = idempotent_core::SqliteStore::connect(&format!(
        "sqlite://{}",
        dir.path().join("tx.db").display()
    ))
    .await
    .unwrap();
    store.migrate().await.unwrap();
    sqlx::raw_sql("CREATE TABLE tx_business (id TEXT PRIMARY KEY)")
        .execute(store.pool())
        .await
        .unwrap();
    let pool = store.pool().clone();
    let s = serve(fw, config(store)).await;
    "tx_business".clone_into(&mut s.app.tx.table.lock().unwrap());
    tx_cycle(&s, "/tx/sqlite", || async {
        sqlx::query_scalar("SELECT count(*) FROM tx_business")
            .fetch_one(&pool)
            .await
            .unwrap()
    })
    .await;
    refuses_the_wrong_database(&s, "/tx/postgres", "PostgreSQL").await;
}

/// On PostgreSQL, plus the fault: the handler's connection is terminated while it holds its
/// transaction (`pg_terminate_backend`): the client gets a 503 problem with `Retry-After`,
/// nothing is half-written, and the retry runs once.
async fn transactional_routes_on_postgres(fw: Fw) {
    let pool = idempotent_tests::fixtures::pg_pool(16).await;
    let table = idempotent_tests::fixtures::unique_table("e2etx");
    let store = idempotent_tests::fixtures::pg_store(pool.clone(), &table).await;
    let business = format!("idempotent_test.{table}_biz");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {business} (id text PRIMARY KEY)"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let s = serve(fw, config(store)).await;
    s.app.tx.table.lock().unwrap().clone_from(&business);
    let count = format!("SELECT count(*) FROM {business}");
    let rows = || async {
        sqlx::query_scalar(sqlx::AssertSqlSafe(count.clone()))
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    tx_cycle(&s, "/tx/postgres", rows).await;
    refuses_the_wrong_database(&s, "/tx/sqlite", "SQLite").await;
    refuses_the_wrong_database(&s, "/tx/mysql", "MySQL").await;

    *s.app.tx.pid.lock().unwrap() = None;
    let id = || s.app.tx.pid.lock().unwrap().map(i64::from);
    let admin = pool.clone();
    killed_mid_transaction(&s, "/tx/postgres", rows, id, |pid| async move {
        let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1::int4)")
            .bind(pid)
            .fetch_one(&admin)
            .await
            .unwrap();
        assert!(killed);
    })
    .await;
    idempotent_tests::fixtures::pg_drop(&pool, &table).await;
    let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP TABLE {business}")))
        .execute(&pool)
        .await;
}

/// On MySQL (MariaDB): the cycle, and the fault: the handler's connection is killed (`KILL`)
/// while it holds its transaction (and the key's named lock): 503 with `Retry-After`,
/// nothing half-written, and the retry runs once (the server released the lock with the
/// session).
async fn transactional_routes_on_mysql(fw: Fw) {
    let pool = idempotent_tests::fixtures::mysql_pool(16).await;
    let table = idempotent_tests::fixtures::unique_table("e2etx");
    let store = idempotent_tests::fixtures::mysql_store(pool.clone(), &table).await;
    let business = format!("{table}_biz");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {business} (id VARCHAR(64) PRIMARY KEY) ENGINE = InnoDB"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let s = serve(fw, config(store)).await;
    s.app.tx.table.lock().unwrap().clone_from(&business);
    let count = format!("SELECT count(*) FROM {business}");
    let rows = || async {
        sqlx::query_scalar(sqlx::AssertSqlSafe(count.clone()))
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    tx_cycle(&s, "/tx/mysql", rows).await;
    refuses_the_wrong_database(&s, "/tx/sqlite", "SQLite").await;
    refuses_the_wrong_database(&s, "/tx/postgres", "PostgreSQL").await;

    *s.app.tx.mysql_id.lock().unwrap() = None;
    let id = || *s.app.tx.mysql_id.lock().unwrap();
    let admin = pool.clone();
    killed_mid_transaction(&s, "/tx/mysql", rows, id, |id| async move {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("KILL {id}")))
            .execute(&admin)
            .await
            .unwrap();
    })
    .await;
    idempotent_tests::fixtures::mysql_drop(&pool, &table).await;
    let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP TABLE {business}")))
        .execute(&pool)
        .await;
}

/// The fault on a transactional route: the handler's connection is ended (`kill`, given the
/// session id `id` recorded after the handler's INSERT) while it holds its transaction: 503
/// with `Retry-After`, nothing half-written (`rows`), and the retry runs once.
async fn killed_mid_transaction<R, RFut, I, K, KFut>(
    s: &Server,
    path: &str,
    rows: R,
    id: I,
    kill: K,
) where
    R: Fn() -> RFut,
    RFut: std::future::Future<Output = i64>,
    I: Fn() -> Option<i64>,
    K: FnOnce(i64) -> KFut,
    KFut: std::future::Future<Output = ()>,
{
    let (runs, before) = (s.runs(), rows().await);
    s.app.tx.hold_ms.store(1_000, Ordering::SeqCst);
    let k = key();
    let pending = tokio::spawn(s.post(path, "", Some(&k), r#"{"status": 201}"#).send());
    // Recorded after the handler's INSERT, while it holds its transaction.
    let mut recorded = None;
    for _ in 0..1_000 {
        recorded = id();
        if recorded.is_some() || pending.is_finished() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    kill(recorded.expect("the handler reached its hold")).await;
    let res = pending.await.unwrap().unwrap();
    assert_eq!(res.headers()["retry-after"], "1");
    problem(res, 503, "idempotency-store-unavailable").await;
    assert_eq!(rows().await, before, "nothing half-written");
    s.app.tx.hold_ms.store(0, Ordering::SeqCst);
    let retry = s
        .until_not_busy(|| s.post(path, "", Some(&k), r#"{"status": 201}"#))
        .await;
    assert_eq!(retry.status(), 201);
    assert_eq!(retry.headers()["idempotent-replayed"], "false");
    assert_eq!((s.runs() - runs, rows().await), (2, before + 1));
}

async fn failing_store_answers_503_and_never_runs_the_handler(fw: Fw) {
    // Every claim fails as a store that cannot be reached does.
    let store = FaultyStore::new(MemoryStore::new());
    store.fail_next_claims(usize::MAX);
    let s = serve(fw, config(store.clone())).await;
    let charge = || s.post("/v1/charges", "acct_a", Some("k"), r#"{"amount": 1}"#);
    let res = charge().send().await.unwrap();
    assert_eq!(res.status(), 503, "with the store down");
    assert_eq!(res.headers()["retry-after"], "1");
    problem(res, 503, "idempotency-store-unavailable").await;
    assert_eq!(store.injected(), 1, "the claim reached the failing store");
    assert_eq!(s.runs(), 0, "the handler ran with the store down");
    // Once the store answers again, the key was never recorded: the retry runs, once.
    store.fail_next_claims(0);
    let res = charge().send().await.unwrap();
    assert_eq!(res.status(), 201);
    assert_eq!(res.headers()["idempotent-replayed"], "false");
    assert_eq!(s.runs(), 1);
}

/// A store at its total bound refuses new keys with 503 (no record, so a retry may run once
/// space frees); the handler does not run.
async fn a_full_store_answers_503_and_never_runs_the_handler(fw: Fw) {
    let s = serve(fw, config(MemoryStore::builder().max_entries(0).build())).await;
    let res = s
        .post("/v1/charges", "acct_a", Some("k"), r#"{"amount": 1}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(res.headers()["retry-after"], "1");
    problem(res, 503, "idempotency-store-unavailable").await;
    assert_eq!(s.runs(), 0);
}

/// `body` gzipped with `mtime` in its header: the same JSON, other bytes.
fn gzip(body: &str, mtime: u32) -> Vec<u8> {
    use std::io::Write;
    let mut out = flate2::GzBuilder::new()
        .mtime(mtime)
        .write(Vec::new(), flate2::Compression::default());
    out.write_all(body.as_bytes()).unwrap();
    out.finish().unwrap()
}

/// A gzip body is fingerprinted decoded (actix-web's extractors decode it; on Axum,
/// tower-http's decompression layer does): a retry whose compressor wrote another timestamp
/// replays, the same key for another decoded body is 422, a body that does not decode is 400
/// and claims nothing, and the request limit applies to the decoded bytes (a zstd bomb is 413).
/// Both frameworks answer alike.
async fn compressed_bodies_are_fingerprinted_decoded(fw: Fw) {
    let s = serve(fw, limited(MemoryStore::new())).await;
    let send = |key: &str, body: Vec<u8>| {
        s.post("/v1/charges", "acct_a", Some(key), "")
            .header("content-encoding", "gzip")
            .body(body)
            .send()
    };
    let json = r#"{"amount": 40}"#;
    let first = send("gz", gzip(json, 1)).await.unwrap();
    assert_eq!(first.status(), 201);
    assert_eq!(first.headers()["idempotent-replayed"], "false");
    let first: Value = first.json().await.unwrap();
    // Another timestamp, and the same JSON with its keys spaced otherwise.
    for retry in [gzip(json, 2), gzip(r#"{ "amount":40 }"#, 3)] {
        assert_ne!(retry, gzip(json, 1));
        let res = send("gz", retry).await.unwrap();
        assert_eq!(res.status(), 201, "{fw:?}: a recompressed retry");
        assert_eq!(res.headers()["idempotent-replayed"], "true");
        assert_eq!(res.json::<Value>().await.unwrap(), first);
    }
    assert_eq!(s.runs(), 1);
    // The plain body is the same request as its gzip.
    let res = s
        .post("/v1/charges", "acct_a", Some("gz"), json)
        .send()
        .await
        .unwrap();
    assert_eq!(res.headers()["idempotent-replayed"], "true", "{fw:?}");
    problem(
        send("gz", gzip(r#"{"amount": 41}"#, 1)).await.unwrap(),
        422,
        "idempotency-key-mismatch",
    )
    .await;
    // Not gzip at all: 400 from the decoder (ours on Actix, tower-http's on Axum), no claim.
    let res = send("broken", b"not gzip".to_vec()).await.unwrap();
    assert_eq!(res.status(), 400, "{fw:?}");
    // Over the 1 KiB limit once decoded, though a few dozen bytes sent: 413.
    let big = format!(r#"{{"amount": 1, "pad": "{}"}}"#, "a".repeat(4096));
    let packed = gzip(&big, 1);
    assert!(packed.len() < 1024);
    problem(
        send("big", packed).await.unwrap(),
        413,
        "idempotency-request-too-large",
    )
    .await;
    // A bomb: a few hundred bytes of zstd that decode to 16 MiB. 413 once the decoded bytes
    // pass the limit; decoding stops there (actix-web's own decoder would build the whole
    // 16 MiB first).
    let bomb = zstd::encode_all(&vec![0_u8; 16 << 20][..], 19).unwrap();
    assert!(bomb.len() < 1024, "{}", bomb.len());
    let res = s
        .post("/v1/charges", "acct_a", Some("bomb"), "")
        .header("content-encoding", "zstd")
        .body(bomb)
        .send()
        .await
        .unwrap();
    problem(res, 413, "idempotency-request-too-large").await;
    assert_eq!(s.runs(), 1);
    // No failed request claimed its key.
    let res = send("broken", gzip(json, 9)).await.unwrap();
    assert_eq!(res.headers()["idempotent-replayed"], "false");
}

/// Database errors, table names and SQL go to the log, never into a problem body.
async fn problems_carry_no_internals(fw: Fw) {
    let dir = tempfile::tempdir().unwrap();
    let store = idempotent_core::SqliteStore::connect(&format!(
        "sqlite://{}",
        dir.path().join("internals.db").display()
    ))
    .await
    .unwrap();
    store.migrate().await.unwrap();
    sqlx::query("DROP TABLE idempotency_records")
        .execute(store.pool())
        .await
        .unwrap();
    let s = serve(fw, config(store)).await;
    let res = s
        .post("/v1/charges", "acct_a", Some("k"), r#"{"amount": 1}"#)
        .send()
        .await
        .unwrap();
    let body = problem(res, 503, "idempotency-store-unavailable").await;
    let text = body.to_string().to_ascii_lowercase();
    for leak in [
        "idempotency_records",
        "no such table",
        "sqlite",
        "database",
        "select",
        "error returned",
    ] {
        assert!(!text.contains(leak), "`{leak}` leaked into {body}");
    }
    assert_eq!(s.runs(), 0);
}

async fn oversized_responses_optional_keys_and_request_limits(fw: Fw) {
    let s = serve(fw, limited(MemoryStore::new())).await;
    // A response over the route's limit is returned in full, not stored; the retry gets 410
    // and the handler does not run again.
    let post = |path: &str, key: Option<&str>, body: String| {
        let mut r = s.client.post(format!("{}{path}", s.base)).body(body);
        if let Some(k) = key {
            r = r.header("idempotency-key", k);
        }
        r.send()
    };
    let first = post("/big", Some("big-1"), String::new()).await.unwrap();
    assert_eq!(first.status(), 200);
    assert_eq!(first.text().await.unwrap().len(), 100);
    problem(
        post("/big", Some("big-1"), String::new()).await.unwrap(),
        410,
        "idempotency-response-not-stored",
    )
    .await;
    // key = "optional": no key runs unprotected every time; a key still protects.
    for _ in 0..2 {
        assert_eq!(
            post("/optional", None, String::new())
                .await
                .unwrap()
                .status(),
            204
        );
    }
    assert_eq!(s.runs(), 2);
    for _ in 0..2 {
        assert_eq!(
            post("/optional", Some("opt-1"), String::new())
                .await
                .unwrap()
                .status(),
            204
        );
    }
    assert_eq!(s.runs(), 3);
    problem(
        post("/optional", Some(""), String::new()).await.unwrap(),
        400,
        "idempotency-key-invalid",
    )
    .await;
    // Without a key the optional route runs unprotected: its body is the handler's business,
    // not refused by our limit.
    assert_eq!(
        post("/optional", None, "y".repeat(2048))
            .await
            .unwrap()
            .status(),
        204
    );
    assert_eq!(s.runs(), 4);
    // Bodies over the limit are refused before anything else.
    problem(
        post("/optional", Some("opt-2"), "y".repeat(2048))
            .await
            .unwrap(),
        413,
        "idempotency-request-too-large",
    )
    .await;
    assert_eq!(s.runs(), 4);
}

async fn missing_middleware_is_a_clear_500(fw: Fw) {
    let s = serve_wired(fw, config(MemoryStore::new()), false).await;
    let res = s
        .client
        .post(format!("{}/v1/refunds", s.base))
        .header("authorization", "Bearer a")
        .header("idempotency-key", "k")
        .json(&serde_json::json!({}))
        .send()
        .await
        .unwrap();
    problem(res, 500, "idempotency-misconfigured").await;
}

/// Sends raw bytes on a fresh connection and returns what the server answers within 5 s
/// (without closing our side first, so a server waiting for more body would time out).
async fn raw(addr: std::net::SocketAddr, request: &[u8]) -> String {
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    conn.write_all(request).await.unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let read = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let n = conn.read(&mut buf).await.unwrap_or(0);
            if n == 0 {
                break;
            }
            out.extend_from_slice(&buf[..n]);
            let text = String::from_utf8_lossy(&out);
            if let Some((head, body)) = text.split_once("\r\n\r\n")
                && let Some(len) = head.lines().find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length: ")
                        .map(str::to_owned)
                })
                && body.len() >= len.trim().parse::<usize>().unwrap()
            {
                break;
            }
        }
    })
    .await;
    assert!(
        read.is_ok(),
        "no answer within 5 s; got {:?}",
        String::from_utf8_lossy(&out)
    );
    String::from_utf8_lossy(&out).into_owned()
}

fn head(key_line: &str, extra: &str) -> String {
    format!(
        "POST /v1/charges HTTP/1.1\r\nhost: x\r\nauthorization: Bearer acct_a\r\ncontent-type: application/json\r\n{key_line}{extra}\r\n"
    )
}

/// The cheap checks answer before a byte of the body is read, and no store is touched.
async fn cheap_rejections_come_first(fw: Fw) {
    let store = FaultyStore::new(MemoryStore::new());
    let s = serve(fw, limited(store.clone())).await;
    // A malformed key with a body that never comes: answered 400 at once.
    let answer = raw(
        s.addr,
        head("idempotency-key: \"bad\r\n", "content-length: 1000\r\n").as_bytes(),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains("idempotency-key-invalid"), "{answer}");
    // A missing key, likewise.
    let answer = raw(s.addr, head("", "content-length: 1000\r\n").as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains("idempotency-key-missing"), "{answer}");
    // A declared length over the limit: 413 before reading.
    let answer = raw(
        s.addr,
        head("idempotency-key: k1\r\n", "content-length: 999999\r\n").as_bytes(),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    // A missing key and a body that is not JSON: the key's problem, not the body's.
    let res = s
        .post("/v1/charges", "acct_a", None, "{not json")
        .send()
        .await
        .unwrap();
    problem(res, 400, "idempotency-key-missing").await;
    assert_eq!((store.claims(), s.runs()), (0, 0));
}

/// A chunked body (no declared length) that passes the limit while it is read: 413.
async fn chunked_bodies_over_the_limit_are_413(fw: Fw) {
    let store = FaultyStore::new(MemoryStore::new());
    let s = serve(fw, limited(store.clone())).await;
    let chunk = "x".repeat(600);
    let request = format!(
        "{}258\r\n{chunk}\r\n258\r\n{chunk}\r\n0\r\n\r\n",
        head("idempotency-key: k1\r\n", "transfer-encoding: chunked\r\n")
    );
    let answer = raw(s.addr, request.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("idempotency-request-too-large"), "{answer}");
    // Our limit answers before the handler's own extractors would refuse the request (no
    // credentials, a media type its JSON extractor refuses): the same order on both frameworks.
    let unauthenticated = format!(
        "POST /v1/charges HTTP/1.1\r\nhost: x\r\ncontent-type: text/plain\r\nidempotency-key: k2\r\ntransfer-encoding: chunked\r\n\r\n258\r\n{chunk}\r\n258\r\n{chunk}\r\n0\r\n\r\n"
    );
    let answer = raw(s.addr, unauthenticated.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("idempotency-request-too-large"), "{answer}");
    assert_eq!((store.claims(), s.runs()), (0, 0));
}

/// The client gives up while the claim is on its way (committed, answer not yet back): the
/// handler still runs once and its response is stored, instead of the key sitting claimed and
/// unused until its lease ends.
async fn client_gone_during_the_claim_still_runs_the_handler(fw: Fw) {
    let store = FaultyStore::new(MemoryStore::new());
    let s = serve(fw, config(store.clone())).await;
    store.delay_claims(Duration::from_millis(300));
    let k = key();
    let gone = s
        .post("/v1/charges", "acct_a", Some(&k), r#"{"amount": 1}"#)
        .timeout(Duration::from_millis(100))
        .send()
        .await;
    assert!(gone.unwrap_err().is_timeout());
    store.delay_claims(Duration::ZERO);
    let replay = s
        .until_not_busy(|| s.post("/v1/charges", "acct_a", Some(&k), r#"{"amount": 1}"#))
        .await;
    assert_eq!(replay.status(), 201);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(s.runs(), 1);
}

/// An endless stream whose client left is read on for at most the route's lease, then stored
/// as not replayable (410) and dropped: the key does not stay in progress for good.
async fn an_endless_stream_whose_client_left_is_bounded(fw: Fw) {
    let s = serve(fw, config(MemoryStore::new())).await;
    let k = key();
    let mut res = s
        .raw_post("/stream/endless", &k, "text/plain", "")
        .send()
        .await
        .unwrap();
    assert_eq!(res.chunk().await.unwrap().unwrap(), "tick;");
    drop(res);
    let gone = s
        .until_not_busy(|| s.raw_post("/stream/endless", &k, "text/plain", ""))
        .await;
    problem(gone, 410, "idempotency-response-not-stored").await;
    assert_eq!(s.runs(), 1);
    let drained = s.engine.drain(Duration::from_secs(5)).await;
    assert_eq!(drained.still_running, 0);
}

/// Issue 49 (3): a client that reads a streamed response's head and then stops reading, while
/// staying connected, must not hold its key in progress for as long as its connection lives.
/// Once the buffers between them are full the server stops polling the body, so the body's
/// own lease of silence is never checked; the execution's heartbeat sees that nothing has
/// moved for a lease and stores the "not stored" marker, and a retry gets 410. On TCP and on
/// a Unix socket, in small and large chunks, from a handler that answers at once and from one
/// that takes more than half its lease (whose heartbeat started before the body was watched).
/// Before the fix the heartbeat kept renewing and every retry got 409 for as long as the
/// connection stayed open.
async fn a_client_that_stops_reading_never_holds_its_key(fw: Fw) {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("idempotent.sock");
    let tcp = serve(fw, config(MemoryStore::new())).await;
    let app = App::default();
    match fw {
        Fw::Axum => axum_app::serve_unix(config(MemoryStore::new()), &app, &socket).await,
        Fw::Actix => actix_app::serve_unix(config(MemoryStore::new()), &app, &socket),
    }
    // (transport, chunk size, how long the handler takes before it answers: past half the
    // lease, its heartbeat has started before the body is watched)
    let cases = [
        (false, 16, 0),
        (false, 65_536, 0),
        (true, 16, 0),
        (true, 65_536, 0),
        (false, 16, 300),
        (true, 65_536, 300),
    ];
    for (unix, size, delay) in cases {
        {
            let k = key();
            let body = format!("{size} {delay}");
            let request = format!(
                "POST /stream/flood HTTP/1.1\r\nhost: x\r\nidempotency-key: {k}\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            );
            let connect = || async {
                if unix {
                    Conn::Unix(tokio::net::UnixStream::connect(&socket).await.unwrap())
                } else {
                    Conn::Tcp(tokio::net::TcpStream::connect(tcp.addr).await.unwrap())
                }
            };
            // The client that stops reading after the head (and staying connected).
            let mut stalled = connect().await;
            stalled.write_all(request.as_bytes()).await.unwrap();
            let mut head = Vec::new();
            let mut buf = [0_u8; 1024];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = stalled.read(&mut buf).await.unwrap();
                assert!(n > 0, "closed before the head");
                head.extend_from_slice(&buf[..n]);
            }
            assert!(
                head.starts_with(b"HTTP/1.1 200"),
                "{}",
                String::from_utf8_lossy(&head)
            );
            // Retries: 409 while the stream is recorded, then 410 (not stored, never again run).
            let started = std::time::Instant::now();
            let answer = loop {
                let mut retry = connect().await;
                retry.write_all(request.as_bytes()).await.unwrap();
                let answer = retry.read_answer().await;
                if !answer.starts_with("HTTP/1.1 409") {
                    break answer;
                }
                assert!(
                    started.elapsed() < Duration::from_secs(10),
                    "unix {unix}, chunks of {size}: still in progress after {:?} (20 leases)",
                    started.elapsed()
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            };
            assert!(
                answer.starts_with("HTTP/1.1 410"),
                "unix {unix}, {size}: {answer}"
            );
            assert!(
                answer.contains("idempotency-response-not-stored"),
                "{answer}"
            );
            drop(stalled);
        }
    }
    assert_eq!(
        tcp.runs() + app.runs.load(Ordering::SeqCst),
        cases.len(),
        "one run per key"
    );
}

/// `chunk` again and again, for ever, as fast as it is read: it yields to the runtime every
/// 64 chunks, as a stream that reads from somewhere does (an always-ready stream that never
/// yields would hold its worker, and the lease's heartbeat on it, for as long as the socket
/// takes its bytes: on Actix's one-thread worker, a frozen owner).
pub(crate) fn flood(chunk: bytes::Bytes) -> impl futures_util::Stream<Item = bytes::Bytes> {
    futures_util::stream::unfold(0_u64, move |n| {
        let chunk = chunk.clone();
        async move {
            if n % 64 == 63 {
                tokio::task::yield_now().await;
            }
            Some((chunk, n + 1))
        }
    })
}

/// A client connection on TCP or a Unix socket.
enum Conn {
    Tcp(tokio::net::TcpStream),
    Unix(tokio::net::UnixStream),
}

impl Conn {
    async fn write_all(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        match self {
            Conn::Tcp(c) => c.write_all(bytes).await,
            Conn::Unix(c) => c.write_all(bytes).await,
        }
    }
    async fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Conn::Tcp(c) => c.read(buf).await,
            Conn::Unix(c) => c.read(buf).await,
        }
    }
    /// An answer as text: the whole of one with a `content-length` (a problem), the head of
    /// any other (a stream, which is not read on).
    async fn read_answer(&mut self) -> String {
        let mut out = Vec::new();
        let mut buf = [0_u8; 4096];
        loop {
            let n = self.read(&mut buf).await.unwrap();
            out.extend_from_slice(&buf[..n]);
            let text = String::from_utf8_lossy(&out).into_owned();
            if let Some((head, body)) = text.split_once("\r\n\r\n") {
                let len = head.lines().find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length: ")
                        .map(str::to_owned)
                });
                match len {
                    Some(len) if body.len() < len.trim().parse::<usize>().unwrap() => {}
                    Some(_) => return text,
                    None => return head.to_owned(),
                }
            }
            assert!(n > 0, "closed mid-answer: {text}");
        }
    }
}

/// A body that cannot be read is a 400, not a 413; a client that disconnects mid-upload
/// causes no claim and no handler run.
async fn unreadable_bodies_are_400_and_claim_nothing(fw: Fw) {
    let store = FaultyStore::new(MemoryStore::new());
    let s = serve(fw, config(store.clone())).await;
    // Broken chunked framing.
    let request = format!(
        "{}zz\r\nnot a chunk\r\n\r\n",
        head("idempotency-key: k1\r\n", "transfer-encoding: chunked\r\n")
    );
    let answer = raw(s.addr, request.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(
        answer.contains("idempotency-request-body-invalid"),
        "{answer}"
    );
    // Half a body, then the client is gone.
    let mut conn = tokio::net::TcpStream::connect(s.addr).await.unwrap();
    let partial = format!(
        "{}{{\"amount\":",
        head("idempotency-key: k2\r\n", "content-length: 100\r\n")
    );
    conn.write_all(partial.as_bytes()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(conn);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(store.claims(), 0, "nothing was claimed");
    assert_eq!(s.runs(), 0, "nothing ran");
}

/// Unusable settings are refused once, when the configuration is built; a route whose own
/// arguments do not fit the configured defaults answers 500 and never panics or runs.
async fn configuration_errors_never_panic(fw: Fw) {
    let build = |f: fn(ConfigBuilder) -> ConfigBuilder| {
        f(ConfigBuilder::new(Engine::new(MemoryStore::new())))
            .build()
            .err()
    };
    assert!(matches!(
        build(|b| b.ttl(Duration::MAX)),
        Some(ConfigError::TooLong { what: "ttl", .. })
    ));
    assert!(matches!(
        Engine::builder(MemoryStore::new())
            .lease(Duration::ZERO)
            .build()
            .err(),
        Some(ConfigError::TooShort { what: "lease", .. })
    ));
    assert!(matches!(
        build(|b| b.ttl(Duration::from_secs(5))),
        Some(ConfigError::TtlShorterThanLease { .. })
    ));
    let s = serve(
        fw,
        ConfigBuilder::new(
            Engine::builder(MemoryStore::new())
                .lease(Duration::from_secs(300))
                .build()
                .unwrap(),
        )
        .build()
        .unwrap(),
    )
    .await;
    for _ in 0..2 {
        let res = s
            .raw_post("/short-ttl", &key(), "text/plain", "")
            .send()
            .await
            .unwrap();
        problem(res, 500, "idempotency-misconfigured").await;
    }
    assert_eq!(s.runs(), 0);
}

/// A failed `complete` is retried within the lease; if it keeps failing, the record stays in
/// progress (a retry gets 409, not a second execution) until the lease ends.
async fn failed_completes_are_retried_then_hold_the_key(fw: Fw) {
    let store = FaultyStore::new(MemoryStore::new());
    let s = serve(fw, config(store.clone())).await;
    // Two transient failures: the retries store the response.
    store.fail_next_completes(2);
    let k = key();
    let first = s
        .post("/v1/charges", "acct_a", Some(&k), r#"{"amount": 1}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), 201);
    assert_eq!(store.injected(), 2);
    let replay = s
        .post("/v1/charges", "acct_a", Some(&k), r#"{"amount": 1}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(s.runs(), 1);

    // Every complete fails: the client still gets its response; a retry within the lease
    // (2 s on this route) gets 409; after the lease a retry takes over and runs again.
    store.fail_next_completes(usize::MAX);
    let k = key();
    let injected = store.injected();
    let first = s
        .post("/v1/charges", "acct_a", Some(&k), r#"{"amount": 2}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), 201);
    assert!(
        store.injected() - injected >= 3,
        "bounded retries: {}",
        store.injected() - injected
    );
    let busy = s
        .post("/v1/charges", "acct_a", Some(&k), r#"{"amount": 2}"#)
        .send()
        .await
        .unwrap();
    problem(busy, 409, "idempotency-key-in-progress").await;
    assert_eq!(s.runs(), 2, "no second execution within the lease");
    store.fail_next_completes(0);
    let after = s
        .until_not_busy(|| s.post("/v1/charges", "acct_a", Some(&k), r#"{"amount": 2}"#))
        .await;
    assert_eq!(after.status(), 201);
    assert_eq!(after.headers()["idempotent-replayed"], "false");
    assert_eq!(
        s.runs(),
        3,
        "after the lease: the documented limit of plain mode"
    );
}

/// Graceful shutdown: `drain` waits for an execution whose client left.
async fn drain_waits_for_executions_whose_client_left(fw: Fw) {
    let store = MemoryStore::new();
    let s = serve(fw, config(store.clone())).await;
    let k = key();
    let gone = s
        .post("/v1/charges", "acct_a", Some(&k), r#"{"amount": 7}"#)
        .timeout(Duration::from_millis(200))
        .send()
        .await;
    assert!(gone.unwrap_err().is_timeout());
    assert_eq!(s.engine.running(), 1);
    let drained = s.engine.drain(Duration::from_secs(10)).await;
    assert_eq!(drained.still_running, 0);
    // Stored before drain returned; new work is refused while draining.
    let record = store
        .get(&idempotent_core::store::RecordKey::new(
            idempotent_core::Scope::new("acct_a").unwrap(),
            idempotent_core::IdempotencyKey::parse(k.as_bytes()).unwrap(),
        ))
        .await
        .unwrap()
        .unwrap();
    assert!(matches!(
        record.state,
        idempotent_core::store::RecordState::Done { .. }
    ));
    let res = s
        .post("/v1/charges", "acct_a", Some(&key()), r#"{"amount": 1}"#)
        .send()
        .await
        .unwrap();
    problem(res, 503, "idempotency-shutting-down").await;
    assert_eq!(s.runs(), 1);
}

/// Headers a response names in its `Connection` header are hop-by-hop (RFC 9110 §7.6.1), as
/// `Connection` itself is: never stored, so a replay carries none of them, while its
/// end-to-end headers are replayed.
async fn headers_named_in_connection_are_never_replayed(fw: Fw) {
    let s = serve(fw, config(MemoryStore::new())).await;
    let key = key();
    let first = s.post("/hop", "", Some(&key), "{}").send().await.unwrap();
    assert_eq!(first.status(), 201);
    assert_eq!(first.headers()["idempotent-replayed"], "false");
    let replay = s.post("/hop", "", Some(&key), "{}").send().await.unwrap();
    assert_eq!(replay.status(), 201);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(replay.headers()["x-end"], "3", "{:?}", replay.headers());
    for hop in ["connection", "x-hop", "x-other"] {
        assert!(
            replay.headers().get(hop).is_none(),
            "{hop} was replayed: {:?}",
            replay.headers()
        );
    }
    assert_eq!(replay.text().await.unwrap(), "hop");
    assert_eq!(s.runs(), 1);
}

/// Stamps out each test for both frameworks: `on_axum::name` and `on_actix::name`, each
/// with its optional attributes (the PostgreSQL switch).
macro_rules! on_both {
    ($($(#[$attr:meta])* $name:ident),* $(,)?) => {
        mod on_axum {
            $(
                $(#[$attr])*
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::Fw::Axum).await;
                }
            )*
        }
        mod on_actix {
            $(
                $(#[$attr])*
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::Fw::Actix).await;
                }
            )*
        }
    };
}

on_both!(
    contract_on_memory_store,
    contract_on_sqlite_store,
    #[cfg_attr(
        not(pg),
        ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
    )]
    contract_on_postgres_store,
    #[cfg_attr(
        not(mysql_db),
        ignore = "set MYSQL_URL=mysql://… to run the MySQL tests"
    )]
    contract_on_mysql_store,
    #[cfg_attr(
        not(redis_standalone),
        ignore = "set REDIS_URL=redis://… to run the Redis tests"
    )]
    contract_on_redis_standalone,
    #[cfg_attr(
        not(redis_cluster),
        ignore = "set REDIS_CLUSTER_URL=redis+cluster://host:port,… to run the Redis Cluster tests"
    )]
    contract_on_redis_cluster,
    transactional_routes_on_memory_and_sqlite,
    #[cfg_attr(
        not(pg),
        ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
    )]
    transactional_routes_on_postgres,
    #[cfg_attr(
        not(mysql_db),
        ignore = "set MYSQL_URL=mysql://… to run the MySQL tests"
    )]
    transactional_routes_on_mysql,
    failing_store_answers_503_and_never_runs_the_handler,
    a_full_store_answers_503_and_never_runs_the_handler,
    headers_named_in_connection_are_never_replayed,
    problems_carry_no_internals,
    compressed_bodies_are_fingerprinted_decoded,
    oversized_responses_optional_keys_and_request_limits,
    missing_middleware_is_a_clear_500,
    cheap_rejections_come_first,
    chunked_bodies_over_the_limit_are_413,
    client_gone_during_the_claim_still_runs_the_handler,
    client_gone_mid_handler_by_half_close_or_reset,
    an_endless_stream_whose_client_left_is_bounded,
    a_client_that_stops_reading_never_holds_its_key,
    unreadable_bodies_are_400_and_claim_nothing,
    configuration_errors_never_panic,
    failed_completes_are_retried_then_hold_the_key,
    drain_waits_for_executions_whose_client_left,
    derived_keys_are_stable_across_runs_and_instances,
    hostile_keys_are_400_and_claim_nothing,
    thousands_of_headers_are_refused_cleanly,
    slow_bodies_time_out_and_claim_nothing,
    hostile_json_is_fingerprinted_without_harm,
    scope_and_key_values_never_collide,
    function_namespaces_are_no_caller_identity,
    one_caller_cannot_fill_the_memory_store,
);

fn with_secret(store: impl Store, secret: &[u8]) -> Config {
    let engine = Engine::builder(store)
        .derive_secret(idempotent_core::DeriveSecret::new(secret).unwrap())
        .build()
        .unwrap();
    ConfigBuilder::<Config>::new(engine).build().unwrap()
}

/// `idem.derive(..)` in a handler: the same on the re-run after a release, in the replay, and
/// on another instance (another store) with the same secret; different per caller, per key
/// and per secret; without a secret the route answers 500 and its handler never runs.
async fn derived_keys_are_stable_across_runs_and_instances(fw: Fw) {
    const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";
    let s = serve(fw, with_secret(MemoryStore::new(), SECRET)).await;
    let k = key();
    // First run: 503 (released) with the key; the retry runs again and derives the same one.
    let first = s
        .post("/derive", "acct_1", Some(&k), "release")
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), 503);
    let derived = first.text().await.unwrap();
    assert_eq!(derived.len(), 36, "{derived}");
    let again = s
        .post("/derive", "acct_1", Some(&k), "release")
        .send()
        .await
        .unwrap();
    assert_eq!(again.status(), 200);
    assert_eq!(again.headers()["idempotent-replayed"], "false");
    assert_eq!(again.text().await.unwrap(), derived);
    assert_eq!(s.runs(), 2);
    let replay = s
        .post("/derive", "acct_1", Some(&k), "release")
        .send()
        .await
        .unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(replay.text().await.unwrap(), derived);
    // Another caller, another key: other derived keys.
    let other_caller = s
        .post("/derive", "acct_2", Some(&k), "x")
        .send()
        .await
        .unwrap();
    assert_ne!(other_caller.text().await.unwrap(), derived);
    let other_key = s
        .post("/derive", "acct_1", Some(&key()), "x")
        .send()
        .await
        .unwrap();
    assert_ne!(other_key.text().await.unwrap(), derived);
    // Another instance (a restart: a new store, the same secret) derives the same key.
    let restarted = serve(fw, with_secret(MemoryStore::new(), SECRET)).await;
    let there = restarted
        .post("/derive", "acct_1", Some(&k), "x")
        .send()
        .await
        .unwrap();
    assert_eq!(there.text().await.unwrap(), derived);
    let rotated = serve(fw, with_secret(MemoryStore::new(), &[9; 32])).await;
    let elsewhere = rotated
        .post("/derive", "acct_1", Some(&k), "x")
        .send()
        .await
        .unwrap();
    assert_ne!(elsewhere.text().await.unwrap(), derived);
    // A GET ignores the key: each request is an operation of its own, with random keys.
    let get = || {
        s.client
            .get(format!("{}/derive", s.base))
            .header("authorization", "Bearer acct_1")
            .header("idempotency-key", &k)
            .send()
    };
    let (a, b) = (get().await.unwrap(), get().await.unwrap());
    assert_eq!((a.status().as_u16(), b.status().as_u16()), (200, 200));
    let (a, b) = (a.text().await.unwrap(), b.text().await.unwrap());
    assert!(a.len() == 36 && a != b && a != derived, "{a} {b}");
    // No secret: refused before the handler runs, never a key that would change.
    let bare = serve(fw, config(MemoryStore::new())).await;
    let res = bare
        .post("/derive", "acct_1", Some(&k), "x")
        .send()
        .await
        .unwrap();
    problem(res, 500, "idempotency-misconfigured").await;
    assert_eq!(bare.runs(), 0);
}

/// A client that sends its request and then half-closes (FIN) or resets (RST) the connection
/// while the handler runs: the execution completes once and its response is stored.
async fn client_gone_mid_handler_by_half_close_or_reset(fw: Fw) {
    let s = serve(fw, config(MemoryStore::new())).await;
    for reset in [false, true] {
        let before = s.runs();
        let k = key();
        let body = r#"{"amount": 7}"#;
        let request = format!(
            "{}{body}",
            head(
                &format!("idempotency-key: {k}\r\n"),
                &format!("content-length: {}\r\n", body.len())
            )
        );
        let mut conn = tokio::net::TcpStream::connect(s.addr).await.unwrap();
        conn.write_all(request.as_bytes()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        if reset {
            // A zero linger makes the close a reset (RST) at once; nothing blocks on it.
            #[allow(deprecated)]
            conn.set_linger(Some(Duration::ZERO)).unwrap();
            drop(conn);
        } else {
            conn.shutdown().await.unwrap();
            tokio::spawn(async move {
                let mut sink = Vec::new();
                let _ = conn.read_to_end(&mut sink).await;
            });
        }
        let busy = s
            .post("/v1/charges", "acct_a", Some(&k), body)
            .send()
            .await
            .unwrap();
        problem(busy, 409, "idempotency-key-in-progress").await;
        let done = s
            .until_not_busy(|| s.post("/v1/charges", "acct_a", Some(&k), body))
            .await;
        assert_eq!(done.status(), 201, "reset: {reset}");
        assert_eq!(
            done.headers()["idempotent-replayed"],
            "true",
            "reset: {reset}"
        );
        assert_eq!(s.runs() - before, 1, "one execution (reset: {reset})");
    }
}

/// A response as `wire_parity` compares it: the status, every header but the framing ones and
/// `Date` (grouped by name, values in order; the order *between* names is not compared, since
/// actix's header map does not keep it), and the body.
type Snapshot = (u16, Vec<(String, Vec<String>)>, bytes_body::Body);

mod bytes_body {
    /// A body, printed as text when it is text.
    #[derive(PartialEq, Eq)]
    pub(crate) struct Body(pub(crate) Vec<u8>);
    impl std::fmt::Debug for Body {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "{:?}", String::from_utf8_lossy(&self.0))
        }
    }
}

async fn snapshot(res: reqwest::Response) -> Snapshot {
    const FRAMING: [&str; 5] = [
        "date",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
    ];
    let status = res.status().as_u16();
    let mut headers: Vec<(String, Vec<String>)> = Vec::new();
    for name in res.headers().keys() {
        if FRAMING.contains(&name.as_str()) {
            continue;
        }
        let values = res
            .headers()
            .get_all(name)
            .iter()
            .map(|v| v.to_str().unwrap_or("<binary>").to_owned())
            .collect();
        headers.push((name.as_str().to_owned(), values));
    }
    headers.sort();
    (
        status,
        headers,
        bytes_body::Body(res.bytes().await.unwrap().to_vec()),
    )
}

/// Status and body of a raw HTTP/1.1 answer.
fn raw_parts(answer: &str) -> (String, String) {
    let status = answer.lines().next().unwrap_or_default().to_owned();
    let body = answer
        .split_once("\r\n\r\n")
        .map(|x| x.1)
        .unwrap_or_default()
        .to_owned();
    (status, body)
}

/// Everything the library itself writes is the same on both frameworks, byte for byte:
/// statuses, problem bodies, our headers, stored-header sets and replays (`Date`, framing and
/// the order between different header names are not compared). Both servers run the same
/// handlers, so first executions compare whole too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wire_parity() {
    let pair = |config: fn() -> Config| async move {
        (
            serve(Fw::Axum, config()).await,
            serve(Fw::Actix, config()).await,
        )
    };
    let (axum, actix) = pair(|| limited(MemoryStore::new())).await;
    let k = key();
    type Case<'a> = (
        &'a str,
        Box<dyn Fn(&Server) -> reqwest::RequestBuilder + 'a>,
    );
    let cases: Vec<Case<'_>> = vec![
        (
            "first",
            Box::new(|s| s.post("/v1/charges", "acct_a", Some(&k), r#"{"amount": 1}"#)),
        ),
        (
            "replay",
            Box::new(|s| s.post("/v1/charges", "acct_a", Some(&k), r#"{ "amount":1 }"#)),
        ),
        (
            "mismatch",
            Box::new(|s| s.post("/v1/charges", "acct_a", Some(&k), r#"{"amount": 2}"#)),
        ),
        (
            "other route",
            Box::new(|s| s.post("/v1/refunds", "acct_a", Some(&k), r#"{"amount": 1}"#)),
        ),
        (
            "missing",
            Box::new(|s| s.post("/v1/charges", "acct_a", None, "{}")),
        ),
        (
            "empty",
            Box::new(|s| s.post("/v1/charges", "acct_a", Some(""), "{}")),
        ),
        (
            "quoting",
            Box::new(|s| s.post("/v1/charges", "acct_a", Some("\"open"), "{}")),
        ),
        (
            "too long",
            Box::new(|s| s.post("/v1/charges", "acct_a", Some(&"k".repeat(256)), "{}")),
        ),
        (
            "two keys",
            Box::new(|s| {
                s.post("/v1/charges", "acct_a", Some("a"), "{}")
                    .header("idempotency-key", "b")
            }),
        ),
        (
            "413",
            Box::new(|s| s.raw_post("/echo", "big-body", "text/plain", &"y".repeat(2048))),
        ),
        (
            "410 first",
            Box::new(|s| s.raw_post("/big", "big-1", "text/plain", "")),
        ),
        (
            "410",
            Box::new(|s| s.raw_post("/big", "big-1", "text/plain", "")),
        ),
        (
            "stream first",
            Box::new(|s| s.raw_post("/stream/ok", "stream-1", "text/plain", "")),
        ),
        (
            "stream replay",
            Box::new(|s| s.raw_post("/stream/ok", "stream-1", "text/plain", "")),
        ),
        (
            "5xx released",
            Box::new(|s| {
                s.post(
                    "/v1/charges",
                    "acct_a",
                    Some("bad-gateway"),
                    r#"{"amount": 500}"#,
                )
            }),
        ),
    ];
    for (name, case) in &cases {
        let a = snapshot(case(&axum).send().await.unwrap()).await;
        let b = snapshot(case(&actix).send().await.unwrap()).await;
        assert_eq!(a, b, "{name}: axum vs actix");
    }
    // An unreadable body: status line and problem body.
    let broken = format!(
        "{}zz\r\nnot a chunk\r\n\r\n",
        head("idempotency-key: k1\r\n", "transfer-encoding: chunked\r\n")
    );
    assert_eq!(
        raw_parts(&raw(axum.addr, broken.as_bytes()).await),
        raw_parts(&raw(actix.addr, broken.as_bytes()).await),
        "400 unreadable body"
    );
    // 409 while the first attempt runs: same problem, Retry-After within a second.
    let k = key();
    let slow = |s: &Server| s.post("/v1/charges", "acct_a", Some(&k), r#"{"amount": 7}"#);
    let (first_a, first_b) = (
        tokio::spawn(slow(&axum).send()),
        tokio::spawn(slow(&actix).send()),
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (status_a, headers_a, body_a) = snapshot(slow(&axum).send().await.unwrap()).await;
    let (status_b, headers_b, body_b) = snapshot(slow(&actix).send().await.unwrap()).await;
    assert_eq!((status_a, status_b), (409, 409));
    let without = |h: &[(String, Vec<String>)], name: &str| {
        h.iter()
            .filter(|(n, _)| n != name)
            .cloned()
            .collect::<Vec<_>>()
    };
    assert_eq!(
        without(&headers_a, "retry-after"),
        without(&headers_b, "retry-after")
    );
    let secs = |h: &[(String, Vec<String>)]| -> i64 {
        h.iter().find(|(n, _)| n == "retry-after").unwrap().1[0]
            .parse()
            .unwrap()
    };
    assert!((secs(&headers_a) - secs(&headers_b)).abs() <= 1);
    let detail_free = |b: &[u8]| {
        let mut v: Value = serde_json::from_slice(b).unwrap();
        v["detail"] = Value::Null; // carries the seconds left, which differ by timing
        v
    };
    assert_eq!(detail_free(&body_a.0), detail_free(&body_b.0));
    first_a.await.unwrap().unwrap();
    first_b.await.unwrap().unwrap();

    // 503 store unavailable, 503 shutting down, 500 misconfigured.
    let (axum, actix) = pair(|| config(MemoryStore::builder().max_entries(0).build())).await;
    let unavailable = |s: &Server| s.post("/v1/charges", "acct_a", Some("u"), r#"{"amount": 1}"#);
    assert_eq!(
        snapshot(unavailable(&axum).send().await.unwrap()).await,
        snapshot(unavailable(&actix).send().await.unwrap()).await,
        "503 store unavailable"
    );
    let (axum, actix) = pair(|| config(MemoryStore::new())).await;
    axum.engine.drain(Duration::from_millis(10)).await;
    actix.engine.drain(Duration::from_millis(10)).await;
    let draining = |s: &Server| s.post("/v1/charges", "acct_a", Some("d"), r#"{"amount": 1}"#);
    assert_eq!(
        snapshot(draining(&axum).send().await.unwrap()).await,
        snapshot(draining(&actix).send().await.unwrap()).await,
        "503 shutting down"
    );
    let axum = serve_wired(Fw::Axum, config(MemoryStore::new()), false).await;
    let actix = serve_wired(Fw::Actix, config(MemoryStore::new()), false).await;
    let unwired = |s: &Server| s.post("/v1/refunds", "acct_a", Some("m"), "{}");
    assert_eq!(
        snapshot(unwired(&axum).send().await.unwrap()).await,
        snapshot(unwired(&actix).send().await.unwrap()).await,
        "500 misconfigured"
    );
}
