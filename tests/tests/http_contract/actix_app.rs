//! The contract's routes on Actix-web: the same handlers as `axum_app`, in actix's idioms.

use crate::App;
use actix_web::dev::Payload;
use actix_web::http::StatusCode;
use actix_web::web::{self, Bytes};
use actix_web::{FromRequest, HttpRequest, HttpResponse, HttpServer};
use idempotent_actix::sqlx::{MySql, Postgres, Sqlite};
use idempotent_actix::{Idempotency, Idempotent, Transaction, idempotent};
use idempotent_core::http::Config;
use serde_json::{Value, json};
use std::future::{Ready, ready};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Duration;

struct AccountId(String);

impl FromRequest for AccountId {
    type Error = actix_web::Error;
    type Future = Ready<Result<Self, Self::Error>>;
    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        ready(
            req.headers()
                .get("authorization")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
                .filter(|v| !v.is_empty())
                .map(|v| AccountId(v.to_owned()))
                .ok_or_else(|| actix_web::error::ErrorUnauthorized("missing bearer")),
        )
    }
}

#[derive(serde::Deserialize)]
struct NewCharge {
    /// Counted per value as it is parsed ([`crate::parsed`]).
    #[serde(deserialize_with = "crate::counted_amount")]
    amount: i64,
}

#[idempotent(scope = "account_id", lease = "2s")]
async fn create_charge(
    app: web::Data<App>,
    AccountId(account_id): AccountId,
    req: web::Json<NewCharge>,
) -> Result<HttpResponse, actix_web::Error> {
    let n = app.runs.fetch_add(1, Ordering::SeqCst) + 1;
    match req.amount {
        13 if !app.panicked_once.swap(true, Ordering::SeqCst) => panic!("handler exploded"),
        500 => {
            return Ok(HttpResponse::build(StatusCode::BAD_GATEWAY)
                .content_type("text/plain; charset=utf-8")
                .body("provider down"));
        }
        7 => tokio::time::sleep(Duration::from_millis(1500)).await,
        _ => {}
    }
    Ok(HttpResponse::Created()
        .append_header(("x-trace", format!("a{n}")))
        .append_header(("x-trace", format!("b{n}")))
        .json(json!({"id": format!("ch_{n}"), "account": account_id, "amount": req.amount})))
}

/// `/v1/charges` whose body extractor runs on replays from the replay cache too.
#[idempotent(scope = "account_id", extract_on_replay)]
async fn create_checked_charge(
    app: web::Data<App>,
    AccountId(account_id): AccountId,
    req: web::Json<NewCharge>,
) -> HttpResponse {
    let n = app.runs.fetch_add(1, Ordering::SeqCst) + 1;
    HttpResponse::Created().json(serde_json::json!({
        "id": format!("ch_{n}"), "account": account_id, "amount": req.amount
    }))
}

#[idempotent(scope = "account_id")]
async fn create_refund(AccountId(account_id): AccountId, v: web::Json<Value>) -> HttpResponse {
    HttpResponse::Created().body(format!("refund for {account_id}: {}", v.into_inner()))
}

/// A path parameter names the object the operation acts on.
#[idempotent(scope = "account_id")]
async fn refund_order(
    app: web::Data<App>,
    AccountId(account_id): AccountId,
    order: web::Path<String>,
) -> HttpResponse {
    let n = app.runs.fetch_add(1, Ordering::SeqCst) + 1;
    HttpResponse::Created().body(format!("refund {n} of order {order} for {account_id}"))
}

/// Echoes a raw (form) body.
#[idempotent(unscoped)]
async fn echo(app: web::Data<App>, body: String) -> String {
    app.runs.fetch_add(1, Ordering::SeqCst);
    body
}

/// Names two of its headers in `Connection`: hop-by-hop (RFC 9110 §7.6.1), so never replayed.
#[idempotent(unscoped)]
async fn hop(app: web::Data<App>) -> HttpResponse {
    app.runs.fetch_add(1, Ordering::SeqCst);
    HttpResponse::Created()
        .insert_header(("connection", "X-Hop, x-other"))
        .insert_header(("x-hop", "1"))
        .insert_header(("x-other", "2"))
        .insert_header(("x-end", "3"))
        .body("hop")
}

#[idempotent(unscoped, max_response = "16")]
async fn big() -> String {
    "x".repeat(100)
}

#[idempotent(unscoped, key = "optional")]
async fn optional(app: web::Data<App>) -> HttpResponse {
    app.runs.fetch_add(1, Ordering::SeqCst);
    HttpResponse::NoContent().finish()
}

#[idempotent(unscoped)]
async fn list(app: web::Data<App>) -> String {
    format!("runs={}", app.runs.load(Ordering::SeqCst))
}

type Chunk = Result<Bytes, std::io::Error>;

fn chunks(parts: Vec<Result<&'static str, std::io::Error>>) -> Vec<Chunk> {
    parts
        .into_iter()
        .map(|p| p.map(|s| Bytes::from_static(s.as_bytes())))
        .collect()
}

fn stream_of(parts: Vec<Result<&'static str, std::io::Error>>) -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/plain")
        .streaming(futures_util::stream::iter(chunks(parts)))
}

fn failure() -> std::io::Error {
    std::io::Error::other("the stream broke")
}

/// A streamed body of unknown size within the limit.
#[idempotent(unscoped)]
async fn stream_ok(app: web::Data<App>) -> HttpResponse {
    app.runs.fetch_add(1, Ordering::SeqCst);
    stream_of(vec![Ok("chunk-1;"), Ok("chunk-2;"), Ok("chunk-3")])
}

/// A stream over the route's limit.
#[idempotent(unscoped, max_response = "16")]
async fn stream_big(app: web::Data<App>) -> HttpResponse {
    app.runs.fetch_add(1, Ordering::SeqCst);
    stream_of((0..10).map(|_| Ok("0123456789")).collect())
}

/// A stream that fails before it could be stored.
#[idempotent(unscoped)]
async fn stream_fails_early(app: web::Data<App>) -> HttpResponse {
    app.runs.fetch_add(1, Ordering::SeqCst);
    stream_of(vec![Ok("partial"), Err(failure())])
}

/// A stream that fails after passing the limit (the oversized marker is stored by then).
#[idempotent(unscoped, max_response = "16")]
async fn stream_fails_late(app: web::Data<App>) -> HttpResponse {
    app.runs.fetch_add(1, Ordering::SeqCst);
    stream_of(vec![Ok("0123456789"), Ok("0123456789"), Err(failure())])
}

/// Sends "first;", then waits for the test to open the gate before "second".
#[idempotent(unscoped)]
async fn stream_gate(app: web::Data<App>) -> HttpResponse {
    app.runs.fetch_add(1, Ordering::SeqCst);
    let gate = app.gate.clone();
    let rest = futures_util::stream::once(async move {
        gate.notified().await;
        Ok::<_, std::io::Error>(Bytes::from_static(b"second"))
    });
    let first =
        futures_util::stream::iter([Ok::<_, std::io::Error>(Bytes::from_static(b"first;"))]);
    HttpResponse::Ok()
        .content_type("text/plain")
        .streaming(futures_util::StreamExt::chain(first, rest))
}

/// A stream that never ends (an event stream), with a short lease.
#[idempotent(unscoped, lease = "300ms")]
async fn stream_endless(app: web::Data<App>) -> HttpResponse {
    app.runs.fetch_add(1, Ordering::SeqCst);
    let first = futures_util::stream::iter([Ok::<_, std::io::Error>(Bytes::from_static(b"tick;"))]);
    HttpResponse::Ok()
        .content_type("text/plain")
        .streaming(futures_util::StreamExt::chain(
            first,
            futures_util::stream::pending(),
        ))
}

/// An endless stream that is always ready, in chunks of the size the body names: it fills
/// every buffer between it and a client that stops reading (short lease; a limit above what
/// those buffers hold, so only silence can end its recording).
#[idempotent(unscoped, lease = "500ms", max_response = "64MiB")]
async fn stream_flood(app: web::Data<App>, body: String) -> HttpResponse {
    app.runs.fetch_add(1, Ordering::SeqCst);
    // `<chunk size>[ <ms the handler takes first>]`
    let mut words = body.split_whitespace().map(|w| w.parse().unwrap_or(0));
    let size = words.next().unwrap_or(16);
    tokio::time::sleep(Duration::from_millis(words.next().unwrap_or(0) as u64)).await;
    let chunk = Bytes::from(vec![b'x'; size]);
    let chunks = crate::flood(chunk);
    HttpResponse::Ok()
        .content_type("text/plain")
        .streaming(futures_util::StreamExt::map(
            chunks,
            Ok::<_, std::io::Error>,
        ))
}

/// Its ttl is shorter than the lease the misconfiguration test configures.
#[idempotent(unscoped, ttl = "1m")]
async fn short_ttl(app: web::Data<App>) -> HttpResponse {
    app.runs.fetch_add(1, Ordering::SeqCst);
    HttpResponse::Created().finish()
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
    app: web::Data<App>,
    mut tx: Transaction<Sqlite>,
    v: web::Json<Value>,
) -> HttpResponse {
    crate::tx_work(&app, &mut tx).await;
    crate::tx_hold(&app).await;
    HttpResponse::build(status_of(&v)).finish()
}

#[idempotent(unscoped)]
async fn tx_mysql(
    app: web::Data<App>,
    mut tx: Transaction<MySql>,
    v: web::Json<Value>,
) -> HttpResponse {
    crate::tx_work(&app, &mut tx).await;
    crate::tx_record_mysql_id(&app, &mut tx).await;
    crate::tx_hold(&app).await;
    HttpResponse::build(status_of(&v)).finish()
}

#[idempotent(unscoped)]
async fn tx_postgres(
    app: web::Data<App>,
    mut tx: Transaction<Postgres>,
    v: web::Json<Value>,
) -> HttpResponse {
    crate::tx_work(&app, &mut tx).await;
    crate::tx_record_pid(&app, &mut tx).await;
    crate::tx_hold(&app).await;
    HttpResponse::build(status_of(&v)).finish()
}

/// As axum's `/derive`.
#[idempotent(scope = "account_id")]
async fn derive(
    app: web::Data<App>,
    AccountId(account_id): AccountId,
    idem: &Idempotent,
    body: String,
) -> HttpResponse {
    let _ = account_id;
    let n = app.runs.fetch_add(1, Ordering::SeqCst);
    let status = if body == "release" && n % 2 == 0 {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    };
    HttpResponse::build(status).body(idem.derive("payment-provider").to_string())
}

/// A slow charge whose duplicates wait 5 s for its answer (`waits`).
#[idempotent(scope = "account_id", lease = "10s", wait = "5s")]
async fn waited(
    app: web::Data<App>,
    AccountId(account_id): AccountId,
    v: web::Json<Value>,
) -> HttpResponse {
    let (status, body) = crate::waits::work(&app, &account_id, &v).await;
    HttpResponse::build(StatusCode::from_u16(status).unwrap()).json(body)
}

/// The same, waiting as the configuration says.
#[idempotent(scope = "account_id", lease = "10s")]
async fn waited_by_default(
    app: web::Data<App>,
    AccountId(account_id): AccountId,
    v: web::Json<Value>,
) -> HttpResponse {
    let (status, body) = crate::waits::work(&app, &account_id, &v).await;
    HttpResponse::build(StatusCode::from_u16(status).unwrap()).json(body)
}

fn routes(cfg: &mut web::ServiceConfig) {
    cfg.route("/v1/charges", web::post().to(create_charge))
        .route("/v1/charges", web::get().to(list))
        .route("/v1/refunds", web::post().to(create_refund))
        .route("/v1/checked-charges", web::post().to(create_checked_charge))
        .route("/orders/{order}/refund", web::post().to(refund_order))
        .service(web::scope("/v2").route("/orders/{order}/refund", web::post().to(refund_order)))
        .route("/echo", web::post().to(echo))
        .route("/big", web::post().to(big))
        .route("/hop", web::post().to(hop))
        .route("/optional", web::post().to(optional))
        .route("/stream/ok", web::post().to(stream_ok))
        .route("/stream/big", web::post().to(stream_big))
        .route("/stream/fails-early", web::post().to(stream_fails_early))
        .route("/stream/fails-late", web::post().to(stream_fails_late))
        .route("/stream/gate", web::post().to(stream_gate))
        .route("/stream/endless", web::post().to(stream_endless))
        .route("/stream/flood", web::post().to(stream_flood))
        .route("/short-ttl", web::post().to(short_ttl))
        .route("/tx/sqlite", web::post().to(tx_sqlite))
        .route("/tx/postgres", web::post().to(tx_postgres))
        .route("/tx/mysql", web::post().to(tx_mysql))
        .route("/derive", web::post().to(derive))
        .route("/derive", web::get().to(derive))
        .route("/wait", web::post().to(waited))
        .route("/wait/default", web::post().to(waited_by_default));
}

/// Serves the routes on 127.0.0.1 in a thread of its own (an actix system with one worker),
/// with the middleware unless `wired` is false; returns the address.
pub(crate) fn serve(config: Config, app: &App, wired: bool) -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let idempotency = Idempotency::from(config);
    let app = app.clone();
    let (started, ready) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        actix_rt::System::new().block_on(async move {
            let server = HttpServer::new(move || {
                actix_web::App::new()
                    .wrap(actix_web::middleware::Condition::new(
                        wired,
                        idempotency.middleware(),
                    ))
                    .app_data(web::Data::new(app.clone()))
                    .configure(routes)
            })
            .workers(1)
            .disable_signals()
            .listen(listener)
            .unwrap()
            .run();
            started.send(()).unwrap();
            server.await.unwrap();
        });
    });
    ready.recv().unwrap();
    addr
}

/// Serves the routes, with the middleware, on a Unix socket at `path`.
pub(crate) fn serve_unix(config: Config, app: &App, path: &std::path::Path) {
    let idempotency = Idempotency::from(config);
    let (app, path) = (app.clone(), path.to_owned());
    let (started, ready) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        actix_rt::System::new().block_on(async move {
            let server = HttpServer::new(move || {
                actix_web::App::new()
                    .wrap(idempotency.middleware())
                    .app_data(web::Data::new(app.clone()))
                    .configure(routes)
            })
            .workers(1)
            .disable_signals()
            .bind_uds(path)
            .unwrap()
            .run();
            started.send(()).unwrap();
            server.await.unwrap();
        });
    });
    ready.recv().unwrap();
}
