//! The smallest Axum service with safe retries: one `#[idempotent]` POST handler on the
//! in-memory store, scoped by the caller a bearer token authenticates. `actix-minimal` is its
//! twin on Actix-web.
//!
//! ```sh
//! cargo run -p idempotent-examples --bin axum-minimal            # listens on 127.0.0.1:3001
//! curl -i -X POST localhost:3001/v1/orders -H 'Authorization: Bearer tok_alice' \
//!   -H 'Idempotency-Key: order-1' -H 'Content-Type: application/json' \
//!   -d '{"item": "book", "quantity": 2}'
//! ```
//!
//! Run the `curl` twice: the second answer is the first one replayed (`Idempotent-Replayed:
//! true`, the same order id); the same key with another body is a 422.

use axum::extract::FromRequestParts;
use axum::http::{StatusCode, header, request::Parts};
use axum::{Json, Router, routing::post};
use clap::Parser;
use idempotent_axum::{Idempotency, MemoryStore, idempotent};
use serde::Deserialize;
use serde_json::{Value, json};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A minimal idempotent orders API on Axum.
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

impl<S: Send + Sync> FromRequestParts<S> for Caller {
    type Rejection = StatusCode;
    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, StatusCode> {
        let authorization = parts.headers.get(header::AUTHORIZATION);
        account_of(authorization.and_then(|v| v.to_str().ok()))
            .map(Caller)
            .ok_or(StatusCode::UNAUTHORIZED)
    }
}

#[derive(Debug, Deserialize)]
struct NewOrder {
    item: String,
    quantity: u32,
}

static NEXT_ORDER: AtomicU64 = AtomicU64::new(1);

/// Runs once per (account, key); retries get the stored 201 and body back.
#[idempotent(scope = "account")]
async fn create_order(
    Caller(account): Caller,
    Json(req): Json<NewOrder>,
) -> (StatusCode, Json<Value>) {
    let id = format!("ord_{}", NEXT_ORDER.fetch_add(1, Ordering::Relaxed));
    let NewOrder { item, quantity } = req;
    (
        StatusCode::CREATED,
        Json(json!({"id": id, "account": account, "item": item, "quantity": quantity})),
    )
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let idempotency = Idempotency::new(MemoryStore::new());
    let app = Router::new()
        .route("/v1/orders", post(create_order))
        .layer(idempotency.layer());
    let listener = tokio::net::TcpListener::bind(&args.listen).await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    // Handlers whose clients went away still run: let them store their responses.
    let drained = idempotency.drain(Duration::from_secs(30)).await;
    println!("stopped: {drained:?}");
    Ok(())
}
