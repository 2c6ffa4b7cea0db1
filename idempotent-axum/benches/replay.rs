//! What a replay costs in the Axum adapter, in process (no sockets): the same request through
//! the router for a handler whose JSON body extractor still runs on replays, for one that takes
//! the raw body, and for the bare handler without the attribute (which runs every time).
//! The difference between the first two is what deciding replays before the handler's other
//! extractors could save. Then first executions (a new key each) against the bare handler:
//! what the attribute adds to a request, without the sockets and the kernel that
//! `bench-http` measures as well. `cargo bench -p idempotent-axum --bench replay`

use axum::body::{Body, Bytes};
use axum::extract::FromRequestParts;
use axum::http::{Request, StatusCode, request::Parts};
use axum::routing::post;
use axum::{Json, Router};
use criterion::{Criterion, criterion_group, criterion_main};
use idempotent_axum::{Idempotency, MemoryStore, idempotent};
use tower::ServiceExt;

struct Account(String);

impl<S: Send + Sync> FromRequestParts<S> for Account {
    type Rejection = StatusCode;
    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, StatusCode> {
        parts
            .headers
            .get("authorization")
            .and_then(|v| v.to_str().ok()?.strip_prefix("Bearer ").map(str::to_owned))
            .map(Account)
            .ok_or(StatusCode::UNAUTHORIZED)
    }
}

#[derive(serde::Deserialize)]
struct NewCharge {
    amount: u64,
    currency: String,
    customer: String,
}

fn created(
    account: &str,
    amount: u64,
    currency: &str,
    customer: &str,
) -> (StatusCode, Json<serde_json::Value>) {
    (
        StatusCode::CREATED,
        Json(
            serde_json::json!({"id": "ch_1", "account": account, "amount": amount, "currency": currency, "customer": customer}),
        ),
    )
}

#[idempotent(scope = "account")]
async fn with_json(
    Account(account): Account,
    Json(c): Json<NewCharge>,
) -> (StatusCode, Json<serde_json::Value>) {
    created(&account, c.amount, &c.currency, &c.customer)
}

#[idempotent(scope = "account")]
async fn with_bytes(
    Account(account): Account,
    body: Bytes,
) -> (StatusCode, Json<serde_json::Value>) {
    created(&account, body.len() as u64, "usd", "cus_1")
}

async fn bare(
    Account(account): Account,
    Json(c): Json<NewCharge>,
) -> (StatusCode, Json<serde_json::Value>) {
    created(&account, c.amount, &c.currency, &c.customer)
}

const BODY: &str = r#"{"amount": 500, "currency": "usd", "customer": "cus_123"}"#;

fn request(path: &str) -> Request<Body> {
    keyed(
        path,
        format!("8e03978e-40d5-43e8-bc93{}", path.replace('/', "-")),
    )
}

fn keyed(path: &str, key: String) -> Request<Body> {
    Request::post(path)
        .header("authorization", "Bearer acct_1")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Body::from(BODY))
        .expect("request")
}

/// A router with the three routes, on a memory store of its own with no limits.
fn router() -> Router {
    let store = MemoryStore::builder()
        .max_entries(usize::MAX)
        .max_per_scope(usize::MAX)
        .max_bytes(u64::MAX)
        .max_bytes_per_scope(u64::MAX)
        .build();
    Router::new()
        .route("/json", post(with_json))
        .route("/bytes", post(with_bytes))
        .route("/bare", post(bare))
        .layer(Idempotency::new(store).layer())
}

/// Sends `request` through `app` and returns the response's body, checking its status.
async fn send_to(app: &Router, request: Request<Body>) -> Bytes {
    let res = app.clone().oneshot(request).await.expect("infallible");
    let status = res.status();
    let body = axum::body::to_bytes(res.into_body(), usize::MAX)
        .await
        .expect("body");
    assert!(status.is_success(), "{status} {body:?}");
    body
}

fn benches(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let app = router();
    let send = |path: &'static str| {
        let app = app.clone();
        async move { send_to(&app, request(path)).await }
    };
    // First executions, so the benches below measure replays.
    rt.block_on(async {
        send("/json").await;
        send("/bytes").await;
    });
    let mut group = c.benchmark_group("axum_replay");
    group.bench_function("json_extractor", |b| b.to_async(&rt).iter(|| send("/json")));
    group.bench_function("raw_body", |b| b.to_async(&rt).iter(|| send("/bytes")));
    group.bench_function("bare_handler_no_attribute", |b| {
        b.to_async(&rt).iter(|| send("/bare"))
    });
    group.finish();

    // A new key for every request, on one store that keeps them all, as bench-http's server
    // does: the handler runs each time, as the bare one does. (A new store for every sample
    // measured glibc's allocator after the previous sample's records were freed: 7.9 µs a
    // request there, 5.2–6.0 µs on one long-lived store.)
    let mut group = c.benchmark_group("axum_first");
    let first = router();
    let mut next = 0u64;
    group.bench_function("json_extractor", |b| {
        b.to_async(&rt).iter(|| {
            next += 1;
            let (app, key) = (first.clone(), format!("key-{next:016}"));
            async move { send_to(&app, keyed("/json", key)).await }
        })
    });
    group.bench_function("bare_handler_no_attribute", |b| {
        b.to_async(&rt).iter(|| send("/bare"))
    });
    // The bare handler on a router without the layer: what the layer costs a route it does
    // not protect is the difference with the line above.
    let plain: Router = Router::new().route("/bare", post(bare));
    group.bench_function("bare_handler_no_layer", |b| {
        b.to_async(&rt).iter(|| send_to(&plain, request("/bare")))
    });
    group.finish();
}

criterion_group!(replay, benches);
criterion_main!(replay);
