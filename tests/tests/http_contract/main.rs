//! The HTTP contract, written once and run against an Axum server and an Actix-web server
//! exposing the same routes (`axum_app`, `actix_app`), on the memory, SQLite, PostgreSQL,
//! MySQL (MariaDB) and Redis (standalone and cluster) stores, through real servers on
//! 127.0.0.1 with a real HTTP client (and raw TCP where the
//! framing itself is under test): every row of the table in
//! `docs/semantics.md#the-contract-on-the-wire`, the exactly-once cases
//! (client timeouts and disconnects, path parameters, streamed responses) and the failure
//! modes. A difference between the two frameworks on the wire is a bug; `wire_parity` compares
//! them byte for byte where the library writes the response.
//!
//! This file holds the shared harness (the handlers' state, the servers, the request helpers,
//! raw TCP) and the one list of cases `on_both!` stamps out for both frameworks; the cases live
//! in topic modules: `wire` (the contract per store), `clients` (clients that leave), `streams`,
//! `bodies` (admission, limits, decoding), `transactional`, `failures` (store faults, failed
//! completes, misconfiguration, drain), `derived_keys`, `hostile` and `parity`.
#![allow(clippy::unwrap_used)] // tests unwrap freely

mod actix_app;
mod axum_app;
mod bodies;
mod cache;
mod clients;
mod derived_keys;
mod failures;
mod hostile;
mod parity;
mod streams;
mod transactional;
mod waits;
mod wire;

use idempotent_core::http::{Config, ConfigBuilder};
use idempotent_core::{Engine, Store};
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

/// How often each `amount` of `/v1/charges` was parsed by the handler's body extractor (so a
/// test with an amount of its own sees whether its requests' bodies were parsed).
static PARSED: std::sync::Mutex<Vec<(i64, usize)>> = std::sync::Mutex::new(Vec::new());

/// `NewCharge::amount`, counted in [`PARSED`].
pub(crate) fn counted_amount<'de, D: serde::Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
    let amount = <i64 as serde::Deserialize>::deserialize(d)?;
    let mut parsed = PARSED.lock().unwrap();
    match parsed.iter_mut().find(|(a, _)| *a == amount) {
        Some((_, n)) => *n += 1,
        None => parsed.push((amount, 1)),
    }
    Ok(amount)
}

/// How often a body with `amount` was parsed.
pub(crate) fn parsed(amount: i64) -> usize {
    PARSED
        .lock()
        .unwrap()
        .iter()
        .find(|(a, _)| *a == amount)
        .map_or(0, |(_, n)| *n)
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

/// Runs one case on both frameworks side by side, each on a thread and a runtime of its own
/// ([`side_by_side`](idempotent_tests::side_by_side::side_by_side)), naming the framework
/// that failed.
pub(crate) fn on_each<F>(case: fn(Fw) -> F)
where
    F: Future<Output = ()> + 'static,
{
    idempotent_tests::side_by_side::side_by_side([("Axum", Fw::Axum), ("Actix", Fw::Actix)], case);
}

/// Stamps out each case as one test, `on_both::name`, that runs `module::name` on Axum and on
/// Actix-web side by side ([`on_each`]), with its optional attributes (the PostgreSQL switch).
macro_rules! on_both {
    ($($(#[$attr:meta])* $module:ident :: $name:ident),* $(,)?) => {
        mod on_both {
            $(
                $(#[$attr])*
                #[test]
                fn $name() {
                    super::on_each(super::$module::$name);
                }
            )*
        }
    };
}

on_both!(
    wire::contract_on_memory_store,
    wire::contract_on_sqlite_store,
    #[cfg_attr(
        not(pg),
        ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
    )]
    wire::contract_on_postgres_store,
    #[cfg_attr(
        not(mysql_db),
        ignore = "set MYSQL_URL=mysql://… to run the MySQL tests"
    )]
    wire::contract_on_mysql_store,
    #[cfg_attr(
        not(redis_standalone),
        ignore = "set REDIS_URL=redis://… to run the Redis tests"
    )]
    wire::contract_on_redis_standalone,
    #[cfg_attr(
        not(redis_cluster),
        ignore = "set REDIS_CLUSTER_URL=redis+cluster://host:port,… to run the Redis Cluster tests"
    )]
    wire::contract_on_redis_cluster,
    transactional::transactional_routes_on_memory_and_sqlite,
    #[cfg_attr(
        not(pg),
        ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
    )]
    transactional::transactional_routes_on_postgres,
    #[cfg_attr(
        not(mysql_db),
        ignore = "set MYSQL_URL=mysql://… to run the MySQL tests"
    )]
    transactional::transactional_routes_on_mysql,
    failures::failing_store_answers_503_and_never_runs_the_handler,
    failures::a_full_store_answers_503_and_never_runs_the_handler,
    wire::headers_named_in_connection_are_never_replayed,
    failures::problems_carry_no_internals,
    bodies::compressed_bodies_are_fingerprinted_decoded,
    cache::replay_cache_answers_before_the_store_and_the_body_extractor,
    cache::replay_cache_bounds_hold_under_distinct_keys,
    cache::replay_cache_two_instances_and_a_deleted_record,
    #[cfg_attr(
        not(pg),
        ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
    )]
    cache::replay_cache_on_postgres_two_instances_and_a_deleted_record,
    bodies::oversized_responses_optional_keys_and_request_limits,
    failures::missing_middleware_is_a_clear_500,
    bodies::cheap_rejections_come_first,
    bodies::chunked_bodies_over_the_limit_are_413,
    clients::client_gone_during_the_claim_still_runs_the_handler,
    clients::client_gone_mid_handler_by_half_close_or_reset,
    streams::an_endless_stream_whose_client_left_is_bounded,
    streams::a_client_that_stops_reading_never_holds_its_key,
    bodies::unreadable_bodies_are_400_and_claim_nothing,
    failures::configuration_errors_never_panic,
    failures::failed_completes_are_retried_then_hold_the_key,
    failures::drain_waits_for_executions_whose_client_left,
    derived_keys::derived_keys_are_stable_across_runs_and_instances,
    hostile::hostile_keys_are_400_and_claim_nothing,
    hostile::thousands_of_headers_are_refused_cleanly,
    hostile::slow_bodies_time_out_and_claim_nothing,
    hostile::hostile_json_is_fingerprinted_without_harm,
    hostile::scope_and_key_values_never_collide,
    hostile::function_namespaces_are_no_caller_identity,
    hostile::one_caller_cannot_fill_the_memory_store,
    waits::waits_on_memory,
    waits::waits_on_sqlite,
    #[cfg_attr(
        not(pg),
        ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
    )]
    waits::waits_on_postgres,
    #[cfg_attr(
        not(mysql_db),
        ignore = "set MYSQL_URL=mysql://… to run the MySQL tests"
    )]
    waits::waits_on_mysql,
    #[cfg_attr(
        not(redis_standalone),
        ignore = "set REDIS_URL=redis://… to run the Redis tests"
    )]
    waits::waits_on_redis_standalone,
    #[cfg_attr(
        not(redis_cluster),
        ignore = "set REDIS_CLUSTER_URL=redis+cluster://host:port,… to run the Redis Cluster tests"
    )]
    waits::waits_on_redis_cluster,
    waits::waits_end_at_deadlines_bounds_and_departures,
);
