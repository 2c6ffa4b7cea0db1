//! The contract's routes on Axum.

use crate::App;
use axum::body::Body;
use axum::extract::{FromRequestParts, Path, State};
use axum::http::{StatusCode, request::Parts};
use axum::response::AppendHeaders;
use axum::routing::post;
use axum::{Json, Router};
use idempotent_axum::sqlx::{MySql, Postgres, Sqlite};
use idempotent_axum::{Idempotency, Idempotent, Transaction, idempotent};
use idempotent_core::http::Config;
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Duration;

struct AccountId(String);

impl<S: Send + Sync> FromRequestParts<S> for AccountId {
    type Rejection = (StatusCode, &'static str);
    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        parts
            .headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .filter(|v| !v.is_empty())
            .map(|v| AccountId(v.to_owned()))
            .ok_or((StatusCode::UNAUTHORIZED, "missing bearer"))
    }
}

/// Answers the downstream key derived for "payment-provider"; the body `release` answers it
/// with a 503 (so the key is released and the retry runs again).
#[idempotent(scope = "account_id")]
async fn derive(
    State(app): State<App>,
    AccountId(account_id): AccountId,
    idem: Idempotent,
    body: String,
) -> (StatusCode, String) {
    let _ = account_id;
    let n = app.runs.fetch_add(1, Ordering::SeqCst);
    let status = if body == "release" && n % 2 == 0 {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    };
    (status, idem.derive("payment-provider").to_string())
}

#[derive(serde::Deserialize)]
struct NewCharge {
    /// Counted per value as it is parsed ([`crate::parsed`]).
    #[serde(deserialize_with = "crate::counted_amount")]
    amount: i64,
}

type Created = (
    StatusCode,
    AppendHeaders<[(&'static str, String); 2]>,
    Json<Value>,
);

#[idempotent(scope = "account_id", lease = "2s")]
async fn create_charge(
    State(app): State<App>,
    AccountId(account_id): AccountId,
    Json(req): Json<NewCharge>,
) -> Result<Created, (StatusCode, String)> {
    let n = app.runs.fetch_add(1, Ordering::SeqCst) + 1;
    match req.amount {
        13 if !app.panicked_once.swap(true, Ordering::SeqCst) => panic!("handler exploded"),
        500 => return Err((StatusCode::BAD_GATEWAY, "provider down".into())),
        7 => tokio::time::sleep(Duration::from_millis(1500)).await,
        _ => {}
    }
    Ok((
        StatusCode::CREATED,
        AppendHeaders([("x-trace", format!("a{n}")), ("x-trace", format!("b{n}"))]),
        Json(json!({"id": format!("ch_{n}"), "account": account_id, "amount": req.amount})),
    ))
}

/// `/v1/charges` whose body extractor runs on replays from the replay cache too.
#[idempotent(scope = "account_id", extract_on_replay)]
async fn create_checked_charge(
    State(app): State<App>,
    AccountId(account_id): AccountId,
    Json(req): Json<NewCharge>,
) -> (StatusCode, Json<Value>) {
    let n = app.runs.fetch_add(1, Ordering::SeqCst) + 1;
    let body = json!({"id": format!("ch_{n}"), "account": account_id, "amount": req.amount});
    (StatusCode::CREATED, Json(body))
}

#[idempotent(scope = "account_id")]
async fn create_refund(
    AccountId(account_id): AccountId,
    Json(v): Json<Value>,
) -> (StatusCode, String) {
    (StatusCode::CREATED, format!("refund for {account_id}: {v}"))
}

/// A path parameter names the object the operation acts on.
#[idempotent(scope = "account_id")]
async fn refund_order(
    State(app): State<App>,
    AccountId(account_id): AccountId,
    Path(order): Path<String>,
) -> (StatusCode, String) {
    let n = app.runs.fetch_add(1, Ordering::SeqCst) + 1;
    (
        StatusCode::CREATED,
        format!("refund {n} of order {order} for {account_id}"),
    )
}

/// Echoes a raw (form) body.
#[idempotent(unscoped)]
async fn echo(State(app): State<App>, body: String) -> String {
    app.runs.fetch_add(1, Ordering::SeqCst);
    body
}

/// Names two of its headers in `Connection`: hop-by-hop (RFC 9110 §7.6.1), so never replayed.
#[idempotent(unscoped)]
async fn hop(
    State(app): State<App>,
) -> (
    StatusCode,
    AppendHeaders<[(&'static str, &'static str); 4]>,
    &'static str,
) {
    app.runs.fetch_add(1, Ordering::SeqCst);
    (
        StatusCode::CREATED,
        AppendHeaders([
            ("connection", "X-Hop, x-other"),
            ("x-hop", "1"),
            ("x-other", "2"),
            ("x-end", "3"),
        ]),
        "hop",
    )
}

#[idempotent(unscoped, max_response = "16")]
async fn big() -> String {
    "x".repeat(100)
}

#[idempotent(unscoped, key = "optional")]
async fn optional(State(app): State<App>) -> StatusCode {
    app.runs.fetch_add(1, Ordering::SeqCst);
    StatusCode::NO_CONTENT
}

#[idempotent(unscoped)]
async fn list(State(app): State<App>) -> String {
    format!("runs={}", app.runs.load(Ordering::SeqCst))
}

type Chunk = Result<&'static str, std::io::Error>;

/// A streamed `text/plain` body (the same headers as actix's twin).
type Streamed = ([(axum::http::HeaderName, &'static str); 1], Body);

fn streamed(body: Body) -> Streamed {
    ([(axum::http::header::CONTENT_TYPE, "text/plain")], body)
}

fn stream_of(chunks: Vec<Chunk>) -> Streamed {
    streamed(Body::from_stream(futures_util::stream::iter(chunks)))
}

/// A streamed body of unknown size within the limit.
#[idempotent(unscoped)]
async fn stream_ok(State(app): State<App>) -> Streamed {
    app.runs.fetch_add(1, Ordering::SeqCst);
    stream_of(vec![Ok("chunk-1;"), Ok("chunk-2;"), Ok("chunk-3")])
}

/// A stream over the route's limit.
#[idempotent(unscoped, max_response = "16")]
async fn stream_big(State(app): State<App>) -> Streamed {
    app.runs.fetch_add(1, Ordering::SeqCst);
    stream_of((0..10).map(|_| Ok("0123456789")).collect())
}

fn failure() -> std::io::Error {
    std::io::Error::other("the stream broke")
}

/// A stream that fails before it could be stored.
#[idempotent(unscoped)]
async fn stream_fails_early(State(app): State<App>) -> Streamed {
    app.runs.fetch_add(1, Ordering::SeqCst);
    stream_of(vec![Ok("partial"), Err(failure())])
}

/// A stream that fails after passing the limit (the oversized marker is stored by then).
#[idempotent(unscoped, max_response = "16")]
async fn stream_fails_late(State(app): State<App>) -> Streamed {
    app.runs.fetch_add(1, Ordering::SeqCst);
    stream_of(vec![Ok("0123456789"), Ok("0123456789"), Err(failure())])
}

/// Sends "first;", then waits for the test to open the gate before "second" (server-sent
/// events and other slow streams must not be held back by the copy).
#[idempotent(unscoped)]
async fn stream_gate(State(app): State<App>) -> Streamed {
    app.runs.fetch_add(1, Ordering::SeqCst);
    let gate = app.gate.clone();
    let rest = futures_util::stream::once(async move {
        gate.notified().await;
        Ok::<_, std::io::Error>("second")
    });
    let first = futures_util::stream::iter([Ok::<_, std::io::Error>("first;")]);
    streamed(Body::from_stream(futures_util::StreamExt::chain(
        first, rest,
    )))
}

/// A stream that never ends (an event stream), with a short lease.
#[idempotent(unscoped, lease = "300ms")]
async fn stream_endless(State(app): State<App>) -> Streamed {
    app.runs.fetch_add(1, Ordering::SeqCst);
    let first = futures_util::stream::iter([Ok::<_, std::io::Error>("tick;")]);
    streamed(Body::from_stream(futures_util::StreamExt::chain(
        first,
        futures_util::stream::pending(),
    )))
}

/// An endless stream that is always ready, in chunks of the size the body names: it fills
/// every buffer between it and a client that stops reading (short lease; a limit above what
/// those buffers hold, so only silence can end its recording).
#[idempotent(unscoped, lease = "500ms", max_response = "64MiB")]
async fn stream_flood(State(app): State<App>, body: String) -> Streamed {
    app.runs.fetch_add(1, Ordering::SeqCst);
    // `<chunk size>[ <ms the handler takes first>]`
    let mut words = body.split_whitespace().map(|w| w.parse().unwrap_or(0));
    let size = words.next().unwrap_or(16);
    tokio::time::sleep(Duration::from_millis(words.next().unwrap_or(0) as u64)).await;
    let chunk = bytes::Bytes::from(vec![b'x'; size]);
    let chunks = crate::flood(chunk);
    streamed(Body::from_stream(futures_util::StreamExt::map(
        chunks,
        Ok::<_, std::io::Error>,
    )))
}

/// Its ttl is shorter than the lease the tests' configuration sets for the misconfiguration
/// test: the route must answer 500, never panic or run unprotected.
#[idempotent(unscoped, ttl = "1m")]
async fn short_ttl(State(app): State<App>) -> StatusCode {
    app.runs.fetch_add(1, Ordering::SeqCst);
    StatusCode::CREATED
}

fn status_of(v: &Value) -> StatusCode {
    v["status"]
        .as_u64()
        .and_then(|s| u16::try_from(s).ok())
        .and_then(|s| StatusCode::from_u16(s).ok())
        .unwrap_or(StatusCode::CREATED)
}

#[idempotent(unscoped)]
async fn tx_sqlite(
    State(app): State<App>,
    mut tx: Transaction<Sqlite>,
    Json(v): Json<Value>,
) -> StatusCode {
    crate::tx_work(&app, &mut tx).await;
    crate::tx_hold(&app).await;
    status_of(&v)
}

#[idempotent(unscoped)]
async fn tx_postgres(
    State(app): State<App>,
    mut tx: Transaction<Postgres>,
    Json(v): Json<Value>,
) -> StatusCode {
    crate::tx_work(&app, &mut tx).await;
    crate::tx_record_pid(&app, &mut tx).await;
    crate::tx_hold(&app).await;
    status_of(&v)
}

#[idempotent(unscoped)]
async fn tx_mysql(
    State(app): State<App>,
    mut tx: Transaction<MySql>,
    Json(v): Json<Value>,
) -> StatusCode {
    crate::tx_work(&app, &mut tx).await;
    crate::tx_record_mysql_id(&app, &mut tx).await;
    crate::tx_hold(&app).await;
    status_of(&v)
}

/// A slow charge whose duplicates wait 5 s for its answer (`waits`).
#[idempotent(scope = "account_id", lease = "10s", wait = "5s")]
async fn waited(
    State(app): State<App>,
    AccountId(account_id): AccountId,
    Json(v): Json<Value>,
) -> (StatusCode, Json<Value>) {
    let (status, body) = crate::waits::work(&app, &account_id, &v).await;
    (StatusCode::from_u16(status).unwrap(), Json(body))
}

/// The same, waiting as the configuration says.
#[idempotent(scope = "account_id", lease = "10s")]
async fn waited_by_default(
    State(app): State<App>,
    AccountId(account_id): AccountId,
    Json(v): Json<Value>,
) -> (StatusCode, Json<Value>) {
    let (status, body) = crate::waits::work(&app, &account_id, &v).await;
    (StatusCode::from_u16(status).unwrap(), Json(body))
}

fn router(app: &App, idempotency: &Idempotency) -> Router {
    let nested = Router::new().route("/orders/{order}/refund", post(refund_order));
    Router::new()
        .route("/v1/charges", post(create_charge).get(list))
        .route("/v1/refunds", post(create_refund))
        .route("/v1/checked-charges", post(create_checked_charge))
        .route("/orders/{order}/refund", post(refund_order))
        .nest("/v2", nested)
        .route("/echo", post(echo))
        .route("/big", post(big))
        .route("/hop", post(hop))
        .route("/optional", post(optional))
        .route("/stream/ok", post(stream_ok))
        .route("/stream/flood", post(stream_flood))
        .route("/stream/big", post(stream_big))
        .route("/stream/fails-early", post(stream_fails_early))
        .route("/stream/fails-late", post(stream_fails_late))
        .route("/stream/gate", post(stream_gate))
        .route("/stream/endless", post(stream_endless))
        .route("/short-ttl", post(short_ttl))
        .route("/tx/sqlite", post(tx_sqlite))
        .route("/tx/postgres", post(tx_postgres))
        .route("/tx/mysql", post(tx_mysql))
        .route("/derive", post(derive).get(derive))
        .route("/wait", post(waited))
        .route("/wait/default", post(waited_by_default))
        .layer(idempotency.layer())
        // Outside the idempotency layer, as an application would put it: the fingerprint
        // sees the decoded body.
        .layer(tower_http::decompression::RequestDecompressionLayer::new())
        .with_state(app.clone())
}

/// Serves the routes on 127.0.0.1 (with the middleware unless `wired` is false); returns
/// the address.
pub(crate) async fn serve(config: Config, app: &App, wired: bool) -> SocketAddr {
    let router = if wired {
        router(app, &Idempotency::from(config))
    } else {
        Router::new()
            .route("/v1/refunds", post(create_refund))
            .with_state(app.clone())
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    addr
}

/// Serves the routes, with the middleware, on a Unix socket at `path`.
pub(crate) async fn serve_unix(config: Config, app: &App, path: &std::path::Path) {
    let router = router(app, &Idempotency::from(config));
    let listener = tokio::net::UnixListener::bind(path).unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
}
