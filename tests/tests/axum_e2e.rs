//! End to end through a real Axum server on 127.0.0.1 with a real HTTP client, on the memory,
//! SQLite and PostgreSQL stores: every row of DESIGN.md §1's table and the failure modes.
#![allow(clippy::unwrap_used)] // tests unwrap freely

use axum::extract::{FromRequestParts, State};
use axum::http::{StatusCode, request::Parts};
use axum::response::AppendHeaders;
use axum::routing::{get, post};
use axum::{Json, Router};
use idempotent_axum::{Idempotency, MemoryStore, Store, idempotent};
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

#[derive(Clone, Default)]
struct App {
    runs: Arc<AtomicUsize>,
    panicked_once: Arc<AtomicBool>,
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

struct Server {
    base: String,
    app: App,
    client: reqwest::Client,
}

async fn serve(idempotency: Idempotency) -> Server {
    let app = App::default();
    let router = Router::new()
        .route("/v1/charges", post(create_charge).get(list))
        .route("/v1/refunds", post(create_refund))
        .route("/big", post(big))
        .route("/optional", post(optional))
        .layer(idempotency.layer())
        .with_state(app.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    Server {
        base: format!("http://{addr}"),
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
    let key = format!("k-{}", uuid::Uuid::new_v4());

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
    let k2 = format!("k2-{}", uuid::Uuid::new_v4());
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
    let k3 = format!("k3-{}", uuid::Uuid::new_v4());
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
    let k4 = format!("k4-{}", uuid::Uuid::new_v4());
    let boom = s
        .post("/v1/charges", "acct_a", Some(&k4), r#"{"amount": 13}"#)
        .send()
        .await;
    assert!(boom.is_err() || boom.unwrap().status().is_server_error());
    let mut after = None;
    for _ in 0..50 {
        let res = s
            .post("/v1/charges", "acct_a", Some(&k4), r#"{"amount": 13}"#)
            .send()
            .await
            .unwrap();
        if res.status() != 409 {
            after = Some(res);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let after = after.expect("key released after the panic");
    assert_eq!(after.status(), 201);
    assert_eq!(after.headers()["idempotent-replayed"], "false");
    assert_eq!(s.runs(), 7);

    // 32 concurrent identical requests against a slow handler: one execution; the others
    // get 409 with Retry-After, or the replay.
    let k5 = format!("k5-{}", uuid::Uuid::new_v4());
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

    // A client that disconnects mid-handler: the handler future is dropped and the key
    // released, so the retry runs again instead of getting 409 or a replay.
    let k6 = format!("k6-{}", uuid::Uuid::new_v4());
    let before = s.runs();
    let gone = s
        .post("/v1/charges", "acct_a", Some(&k6), r#"{"amount": 7}"#)
        .timeout(Duration::from_millis(300))
        .send()
        .await;
    assert!(gone.is_err(), "the client gave up");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let retry = s
        .post("/v1/charges", "acct_a", Some(&k6), r#"{"amount": 7}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(retry.status(), 201);
    assert_eq!(retry.headers()["idempotent-replayed"], "false");
    assert_eq!(s.runs() - before, 2, "ran again after the disconnect");
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

#[tokio::test]
async fn oversized_responses_optional_keys_and_request_limits() {
    let s = serve(Idempotency::new(MemoryStore::new()).max_request(1024)).await;
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
    // Bodies over the layer's limit are refused before anything else.
    problem(
        post("/optional", Some("opt-2"), "y".repeat(2048))
            .await
            .unwrap(),
        413,
        "idempotency-request-too-large",
    )
    .await;
    assert_eq!(s.runs(), 3);
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

#[allow(dead_code)]
fn get_route_compiles() -> Router<App> {
    Router::new().route("/", get(list))
}
