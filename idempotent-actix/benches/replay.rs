//! What the attribute costs an Actix-web handler in process (no sockets), the counterpart of
//! `idempotent-axum`'s bench: replays of a handler whose `Json` extractor still runs on
//! replays, first executions (a new key each, on one store that keeps them all, as
//! `bench-http`'s server does), and the bare handler without the attribute, which runs every
//! time. `cargo bench -p idempotent-actix --bench replay`

use actix_web::body::MessageBody;
use actix_web::dev::{Payload, Service, ServiceResponse};
use actix_web::http::StatusCode;
use actix_web::web::{self, Json};
use actix_web::{App, FromRequest, HttpRequest, HttpResponse, test};
use criterion::{Criterion, criterion_group, criterion_main};
use idempotent_actix::{Idempotency, MemoryStore, idempotent};
use std::future::{Ready, ready};

/// The caller, from `Authorization: Bearer <account>`: the idempotency scope.
struct Account(String);

impl FromRequest for Account {
    type Error = actix_web::Error;
    type Future = Ready<Result<Self, Self::Error>>;
    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        ready(
            req.headers()
                .get("authorization")
                .and_then(|v| v.to_str().ok()?.strip_prefix("Bearer "))
                .map(|v| Account(v.to_owned()))
                .ok_or_else(|| actix_web::error::ErrorUnauthorized("no bearer token")),
        )
    }
}

#[derive(serde::Deserialize)]
struct NewCharge {
    amount: u64,
    currency: String,
    customer: String,
}

fn created(account: &str, c: &NewCharge) -> HttpResponse {
    HttpResponse::build(StatusCode::CREATED).json(serde_json::json!({
        "id": "ch_1", "account": account, "amount": c.amount,
        "currency": c.currency, "customer": c.customer,
    }))
}

#[idempotent(scope = "account")]
async fn with_json(Account(account): Account, Json(c): Json<NewCharge>) -> HttpResponse {
    created(&account, &c)
}

async fn bare(Account(account): Account, Json(c): Json<NewCharge>) -> HttpResponse {
    created(&account, &c)
}

const BODY: &str = r#"{"amount": 500, "currency": "usd", "customer": "cus_123"}"#;

fn request(path: &str, key: &str) -> test::TestRequest {
    test::TestRequest::post()
        .uri(path)
        .insert_header(("authorization", "Bearer acct_1"))
        .insert_header(("idempotency-key", key))
        .insert_header(("content-type", "application/json"))
        .set_payload(BODY)
}

/// Sends `req` through `app` and returns the response's body, checking its status.
async fn send<S, R, B>(app: &S, req: R) -> web::Bytes
where
    S: Service<R, Response = ServiceResponse<B>, Error = actix_web::Error>,
    B: MessageBody,
{
    let res = test::call_service(app, req).await;
    let status = res.status();
    let body = test::read_body(res).await;
    assert!(status.is_success(), "{status} {body:?}");
    body
}

fn benches(c: &mut Criterion) {
    let system = actix_rt::System::new();
    let store = MemoryStore::builder()
        .max_entries(usize::MAX)
        .max_per_scope(usize::MAX)
        .max_bytes(u64::MAX)
        .max_bytes_per_scope(u64::MAX)
        .build();
    let app = system.block_on(test::init_service(
        App::new()
            .wrap(Idempotency::new(store).middleware())
            .route("/json", web::post().to(with_json))
            .route("/bare", web::post().to(bare)),
    ));
    // A first execution, so the bench below measures replays.
    system.block_on(send(&app, request("/json", "replayed-key").to_request()));
    let mut group = c.benchmark_group("actix_replay");
    group.bench_function("json_extractor", |b| {
        b.iter(|| system.block_on(send(&app, request("/json", "replayed-key").to_request())))
    });
    group.bench_function("bare_handler_no_attribute", |b| {
        b.iter(|| system.block_on(send(&app, request("/bare", "replayed-key").to_request())))
    });
    group.finish();

    let mut group = c.benchmark_group("actix_first");
    let mut next = 0u64;
    group.bench_function("json_extractor", |b| {
        b.iter(|| {
            next += 1;
            let key = format!("key-{next:016}");
            system.block_on(send(&app, request("/json", &key).to_request()))
        })
    });
    group.finish();
}

criterion_group!(replay, benches);
criterion_main!(replay);
