//! What a replay costs in the Axum adapter, in process (no sockets): the same request through
//! the router for a handler whose JSON body extractor still runs on replays, for one that takes
//! the raw body, and for the bare handler without the attribute (which runs every time).
//! The difference between the first two is what deciding replays before the handler's other
//! extractors could save. `cargo bench -p idempotent-axum --bench replay`

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
    Request::post(path)
        .header("authorization", "Bearer acct_1")
        .header(
            "idempotency-key",
            format!("8e03978e-40d5-43e8-bc93{}", path.replace('/', "-")),
        )
        .header("content-type", "application/json")
        .body(Body::from(BODY))
        .expect("request")
}

fn benches(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let app: Router = Router::new()
        .route("/json", post(with_json))
        .route("/bytes", post(with_bytes))
        .route("/bare", post(bare))
        .layer(Idempotency::new(MemoryStore::new()).layer());
    let send = |path: &'static str| {
        let app = app.clone();
        async move {
            let res = app.oneshot(request(path)).await.expect("infallible");
            let status = res.status();
            let body = axum::body::to_bytes(res.into_body(), usize::MAX)
                .await
                .expect("body");
            assert!(status.is_success(), "{status} {body:?}");
            body
        }
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
}

criterion_group!(replay, benches);
criterion_main!(replay);
