//! The smallest Actix-web service with safe retries: one `#[idempotent]` POST handler on the
//! in-memory store, scoped by the caller a bearer token authenticates. The twin of
//! `axum-minimal`, line for line where the frameworks allow.
//!
//! ```sh
//! cargo run -p idempotent-examples --bin actix-minimal           # listens on 127.0.0.1:3001
//! curl -i -X POST localhost:3001/v1/orders -H 'Authorization: Bearer tok_alice' \
//!   -H 'Idempotency-Key: order-1' -H 'Content-Type: application/json' \
//!   -d '{"item": "book", "quantity": 2}'
//! ```
//!
//! Run the `curl` twice: the second answer is the first one replayed (`Idempotent-Replayed:
//! true`, the same order id); the same key with another body is a 422.

use actix_web::dev::Payload;
use actix_web::http::header;
use actix_web::{App, FromRequest, HttpRequest, HttpResponse, HttpServer, post, web};
use clap::Parser;
use idempotent_actix::{Idempotency, MemoryStore, idempotent};
use serde::Deserialize;
use serde_json::json;
use std::future::{Ready, ready};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A minimal idempotent orders API on Actix-web.
#[derive(Debug, Parser)]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:3001")]
    listen: String,
}

/// The account a bearer token authenticates (a real service verifies a session or a JWT).
fn account_of(authorization: Option<&str>) -> Option<&'static str> {
    match authorization?.strip_prefix("Bearer ")? {
        "tok_alice" => Some("acct_alice"),
        "tok_bob" => Some("acct_bob"),
        _ => None,
    }
}

/// The authenticated caller: the idempotency scope, never a value the client picks.
struct Caller(&'static str);

impl FromRequest for Caller {
    type Error = actix_web::Error;
    type Future = Ready<Result<Self, Self::Error>>;
    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        let authorization = req.headers().get(header::AUTHORIZATION);
        ready(
            account_of(authorization.and_then(|v| v.to_str().ok()))
                .map(Caller)
                .ok_or_else(|| actix_web::error::ErrorUnauthorized("unknown bearer token")),
        )
    }
}

#[derive(Debug, Deserialize)]
struct NewOrder {
    item: String,
    quantity: u32,
}

static NEXT_ORDER: AtomicU64 = AtomicU64::new(1);

/// Runs once per (account, key); retries get the stored 201 and body back.
#[post("/v1/orders")]
#[idempotent(scope = "account")]
async fn create_order(Caller(account): Caller, req: web::Json<NewOrder>) -> HttpResponse {
    let id = format!("ord_{}", NEXT_ORDER.fetch_add(1, Ordering::Relaxed));
    let NewOrder { item, quantity } = req.into_inner();
    HttpResponse::Created()
        .json(json!({"id": id, "account": account, "item": item, "quantity": quantity}))
}

#[actix_web::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let idempotency = Idempotency::new(MemoryStore::new());
    let middleware = idempotency.middleware();
    let server = HttpServer::new(move || App::new().wrap(middleware.clone()).service(create_order))
        .disable_signals()
        .bind(&args.listen)?;
    let addr = server
        .addrs()
        .first()
        .copied()
        .ok_or("bound to no address")?;
    println!("listening on http://{addr}");
    let server = server.run();
    let handle = server.handle();
    let stopping = actix_web::rt::spawn(async move {
        let _ = tokio::signal::ctrl_c().await;
        // Stop accepting, let handlers whose clients went away store their responses (they
        // run on the workers' runtimes, which actix's own stop would drop), then stop.
        idempotency
            .stop_server(&handle, Duration::from_secs(30))
            .await
    });
    server.await?;
    let drained = stopping.await?;
    println!("stopped: {drained:?}");
    Ok(())
}
