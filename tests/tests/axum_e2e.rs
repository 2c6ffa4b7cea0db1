//! End to end through a real Axum server on 127.0.0.1 with a real HTTP client, on the memory,
//! SQLite and PostgreSQL stores: every row of DESIGN.md §1's table, the exactly-once cases
//! (client timeouts, path parameters, streamed responses) and the failure modes.
#![allow(clippy::unwrap_used)] // tests unwrap freely

use axum::body::Body;
use axum::extract::{FromRequestParts, Path, State};
use axum::http::{StatusCode, request::Parts};
use axum::response::AppendHeaders;
use axum::routing::{get, post};
use axum::{Json, Router};
use idempotent_axum::{ConfigError, Idempotency, MemoryStore, Store, idempotent};
use idempotent_tests::faults::FaultyStore;
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[derive(Clone, Default)]
struct App {
    runs: Arc<AtomicUsize>,
    panicked_once: Arc<AtomicBool>,
    /// Releases the second half of `/stream/gate`.
    gate: Arc<tokio::sync::Notify>,
}

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

#[derive(serde::Deserialize)]
struct NewCharge {
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

fn stream_of(chunks: Vec<Chunk>) -> Body {
    Body::from_stream(futures_util::stream::iter(chunks))
}

/// A streamed body of unknown size within the limit.
#[idempotent(unscoped)]
async fn stream_ok(State(app): State<App>) -> Body {
    app.runs.fetch_add(1, Ordering::SeqCst);
    stream_of(vec![Ok("chunk-1;"), Ok("chunk-2;"), Ok("chunk-3")])
}

/// A stream over the route's limit.
#[idempotent(unscoped, max_response = "16")]
async fn stream_big(State(app): State<App>) -> Body {
    app.runs.fetch_add(1, Ordering::SeqCst);
    stream_of((0..10).map(|_| Ok("0123456789")).collect())
}

fn failure() -> std::io::Error {
    std::io::Error::other("the stream broke")
}

/// A stream that fails before it could be stored.
#[idempotent(unscoped)]
async fn stream_fails_early(State(app): State<App>) -> Body {
    app.runs.fetch_add(1, Ordering::SeqCst);
    stream_of(vec![Ok("partial"), Err(failure())])
}

/// A stream that fails after passing the limit (the oversized marker is stored by then).
#[idempotent(unscoped, max_response = "16")]
async fn stream_fails_late(State(app): State<App>) -> Body {
    app.runs.fetch_add(1, Ordering::SeqCst);
    stream_of(vec![Ok("0123456789"), Ok("0123456789"), Err(failure())])
}

/// Sends "first;", then waits for the test to open the gate before "second" (server-sent
/// events and other slow streams must not be held back by the copy).
#[idempotent(unscoped)]
async fn stream_gate(State(app): State<App>) -> Body {
    app.runs.fetch_add(1, Ordering::SeqCst);
    let gate = app.gate.clone();
    let rest = futures_util::stream::once(async move {
        gate.notified().await;
        Ok::<_, std::io::Error>("second")
    });
    let first = futures_util::stream::iter([Ok::<_, std::io::Error>("first;")]);
    Body::from_stream(futures_util::StreamExt::chain(first, rest))
}

/// A stream that never ends (an event stream), with a short lease.
#[idempotent(unscoped, lease = "300ms")]
async fn stream_endless(State(app): State<App>) -> Body {
    app.runs.fetch_add(1, Ordering::SeqCst);
    let first = futures_util::stream::iter([Ok::<_, std::io::Error>("tick;")]);
    Body::from_stream(futures_util::StreamExt::chain(
        first,
        futures_util::stream::pending(),
    ))
}

/// Its ttl is shorter than the lease the tests' configuration sets for the misconfiguration
/// test: the route must answer 500, never panic or run unprotected.
#[idempotent(unscoped, ttl = "1m")]
async fn short_ttl(State(app): State<App>) -> StatusCode {
    app.runs.fetch_add(1, Ordering::SeqCst);
    StatusCode::CREATED
}

struct Server {
    base: String,
    addr: std::net::SocketAddr,
    app: App,
    client: reqwest::Client,
}

fn router(app: &App, idempotency: &Idempotency) -> Router {
    let nested = Router::new().route("/orders/{order}/refund", post(refund_order));
    Router::new()
        .route("/v1/charges", post(create_charge).get(list))
        .route("/v1/refunds", post(create_refund))
        .route("/orders/{order}/refund", post(refund_order))
        .nest("/v2", nested)
        .route("/echo", post(echo))
        .route("/big", post(big))
        .route("/optional", post(optional))
        .route("/stream/ok", post(stream_ok))
        .route("/stream/big", post(stream_big))
        .route("/stream/fails-early", post(stream_fails_early))
        .route("/stream/fails-late", post(stream_fails_late))
        .route("/stream/gate", post(stream_gate))
        .route("/stream/endless", post(stream_endless))
        .route("/short-ttl", post(short_ttl))
        .layer(idempotency.layer())
        .with_state(app.clone())
}

async fn serve(idempotency: Idempotency) -> Server {
    let app = App::default();
    let router = router(&app, &idempotency);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    Server {
        base: format!("http://{addr}"),
        addr,
        app,
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
        format!("https://idempotent.dev/problems/{slug}"),
        "{body}"
    );
    assert_eq!(body["status"], status);
    assert!(
        body["title"].is_string() && body["detail"].is_string(),
        "{body}"
    );
    body
}

async fn contract(idempotency: Idempotency) {
    let s = serve(idempotency).await;
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

    // Safe methods ignore the key.
    let list = s
        .client
        .get(format!("{}/v1/charges", s.base))
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contract_on_memory_store() {
    contract(Idempotency::new(MemoryStore::new())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contract_on_sqlite_store() {
    let dir = tempfile::tempdir().unwrap();
    let store = idempotent_axum::SqliteStore::connect(&format!(
        "sqlite://{}",
        dir.path().join("e2e.db").display()
    ))
    .await
    .unwrap();
    store.migrate().await.unwrap();
    contract(Idempotency::new(store)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(pg),
    ignore = "set DATABASE_URL=postgres://… to run the PostgreSQL tests"
)]
async fn contract_on_postgres_store() {
    let pool = idempotent_tests::fixtures::pg_pool(16).await;
    let table = idempotent_tests::fixtures::unique_table("e2e");
    let store = idempotent_tests::fixtures::pg_store(pool.clone(), &table).await;
    contract(Idempotency::new(store)).await;
    idempotent_tests::fixtures::pg_drop(&pool, &table).await;
}

#[tokio::test]
async fn failing_store_answers_503_and_never_runs_the_handler() {
    // A store that cannot hold a single record fails every claim.
    let s = serve(Idempotency::new(
        MemoryStore::builder().max_entries(0).build(),
    ))
    .await;
    let res = s
        .post("/v1/charges", "acct_a", Some("k"), r#"{"amount": 1}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(res.headers()["retry-after"], "1");
    problem(res, 503, "idempotency-store-unavailable").await;
    assert_eq!(s.runs(), 0);
    let _ = MemoryStore::new().purge_expired(1).await; // Store is in scope for users
}

/// Database errors, table names and SQL go to the log, never into a problem body.
#[tokio::test]
async fn problems_carry_no_internals() {
    let dir = tempfile::tempdir().unwrap();
    let store = idempotent_axum::SqliteStore::connect(&format!(
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
    let s = serve(Idempotency::new(store)).await;
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

#[tokio::test]
async fn oversized_responses_optional_keys_and_request_limits() {
    let s = serve(
        Idempotency::builder(MemoryStore::new())
            .max_request(1024)
            .build()
            .unwrap(),
    )
    .await;
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

#[tokio::test]
async fn missing_layer_is_a_clear_500() {
    let router = Router::new().route("/v1/refunds", post(create_refund));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    let res = reqwest::Client::new()
        .post(format!("http://{addr}/v1/refunds"))
        .header("authorization", "Bearer a")
        .header("idempotency-key", "k")
        .json(&json!({}))
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
#[tokio::test]
async fn cheap_rejections_come_first() {
    let store = FaultyStore::new(MemoryStore::new());
    let s = serve(
        Idempotency::builder(store.clone())
            .max_request(1024)
            .build()
            .unwrap(),
    )
    .await;
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
#[tokio::test]
async fn chunked_bodies_over_the_limit_are_413() {
    let store = FaultyStore::new(MemoryStore::new());
    let s = serve(
        Idempotency::builder(store.clone())
            .max_request(1024)
            .build()
            .unwrap(),
    )
    .await;
    let chunk = "x".repeat(600);
    let request = format!(
        "{}258\r\n{chunk}\r\n258\r\n{chunk}\r\n0\r\n\r\n",
        head("idempotency-key: k1\r\n", "transfer-encoding: chunked\r\n")
    );
    let answer = raw(s.addr, request.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("idempotency-request-too-large"), "{answer}");
    assert_eq!((store.claims(), s.runs()), (0, 0));
}

/// The client gives up while the claim is on its way (committed, answer not yet back): the
/// handler still runs once and its response is stored, instead of the key sitting claimed and
/// unused until its lease ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_gone_during_the_claim_still_runs_the_handler() {
    let store = FaultyStore::new(MemoryStore::new());
    let s = serve(Idempotency::new(store.clone())).await;
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
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endless_stream_whose_client_left_is_bounded() {
    let idempotency = Idempotency::new(MemoryStore::new());
    let s = serve(idempotency.clone()).await;
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
    let drained = idempotency.drain(Duration::from_secs(5)).await;
    assert_eq!(drained.still_running, 0);
}

/// A body that cannot be read is a 400, not a 413; a client that disconnects mid-upload
/// causes no claim and no handler run.
#[tokio::test]
async fn unreadable_bodies_are_400_and_claim_nothing() {
    let store = FaultyStore::new(MemoryStore::new());
    let s = serve(Idempotency::new(store.clone())).await;
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
#[tokio::test]
async fn configuration_errors_never_panic() {
    let build =
        |f: fn(idempotent_axum::IdempotencyBuilder) -> idempotent_axum::IdempotencyBuilder| {
            f(Idempotency::builder(MemoryStore::new())).build().err()
        };
    assert!(matches!(
        build(|b| b.ttl(Duration::MAX)),
        Some(ConfigError::TooLong { what: "ttl", .. })
    ));
    assert!(matches!(
        build(|b| b.lease(Duration::ZERO)),
        Some(ConfigError::TooShort { what: "lease", .. })
    ));
    assert!(matches!(
        build(|b| b.ttl(Duration::from_secs(5))),
        Some(ConfigError::TtlShorterThanLease { .. })
    ));
    let s = serve(
        Idempotency::builder(MemoryStore::new())
            .lease(Duration::from_secs(300))
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
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_completes_are_retried_then_hold_the_key() {
    let store = FaultyStore::new(MemoryStore::new());
    let s = serve(Idempotency::new(store.clone())).await;
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
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_waits_for_executions_whose_client_left() {
    let store = MemoryStore::new();
    let idempotency = Idempotency::new(store.clone());
    let s = serve(idempotency.clone()).await;
    let k = key();
    let gone = s
        .post("/v1/charges", "acct_a", Some(&k), r#"{"amount": 7}"#)
        .timeout(Duration::from_millis(200))
        .send()
        .await;
    assert!(gone.unwrap_err().is_timeout());
    assert_eq!(idempotency.engine().running(), 1);
    let drained = idempotency.drain(Duration::from_secs(10)).await;
    assert_eq!(drained.still_running, 0);
    // Stored before drain returned; new work is refused while draining.
    let record = store
        .get(&idempotent_core::RecordKey::new(
            idempotent_core::Scope::new("acct_a").unwrap(),
            idempotent_core::IdempotencyKey::parse(k.as_bytes()).unwrap(),
        ))
        .await
        .unwrap()
        .unwrap();
    assert!(matches!(
        record.state,
        idempotent_core::RecordState::Done { .. }
    ));
    let res = s
        .post("/v1/charges", "acct_a", Some(&key()), r#"{"amount": 1}"#)
        .send()
        .await
        .unwrap();
    problem(res, 503, "idempotency-shutting-down").await;
    assert_eq!(s.runs(), 1);
}

#[allow(dead_code)]
fn get_route_compiles() -> Router<App> {
    Router::new().route("/", get(list))
}
