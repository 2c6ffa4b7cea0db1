//! Transactional mode on SQLite (Axum): the handler writes its order row through the
//! `Transaction<Sqlite>` the attribute hands it, and that row commits together with the stored
//! response, in one commit, or not at all. A retry replays the stored answer and writes no
//! second row; a crash, a panic or a 5xx before the commit leaves neither.
//!
//! ```sh
//! cargo run -p idempotent-examples --bin tx-sqlite    # orders.db, listens on 127.0.0.1:3002
//! curl -i -X POST localhost:3002/v1/orders -H 'Authorization: Bearer tok_alice' \
//!   -H 'Idempotency-Key: order-1' -H 'Content-Type: application/json' \
//!   -d '{"item": "book", "quantity": 2}'
//! sqlite3 orders.db 'SELECT * FROM orders'     # one row per key, however many retries
//! ```

use axum::extract::FromRequestParts;
use axum::http::{StatusCode, header, request::Parts};
use axum::{Json, Router, routing::post};
use clap::Parser;
use idempotent_axum::sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool};
use idempotent_axum::sqlx::{self, Sqlite};
use idempotent_axum::{Idempotency, SqliteStore, Transaction, idempotent};
use serde::Deserialize;
use serde_json::{Value, json};
use std::str::FromStr;
use std::time::Duration;

/// Orders whose rows commit with their idempotency records.
#[derive(Debug, Parser)]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:3002")]
    listen: String,
    /// The SQLite database: the orders table and the idempotency records, side by side.
    #[arg(long, default_value = "sqlite://orders.db")]
    database: String,
}

/// The authenticated caller (as in `axum-minimal`): the idempotency scope.
struct Caller(&'static str);

impl<S: Send + Sync> FromRequestParts<S> for Caller {
    type Rejection = StatusCode;
    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, StatusCode> {
        let token = parts
            .headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        match token.and_then(|t| t.strip_prefix("Bearer ")) {
            Some("tok_alice") => Ok(Caller("acct_alice")),
            Some("tok_bob") => Ok(Caller("acct_bob")),
            _ => Err(StatusCode::UNAUTHORIZED),
        }
    }
}

#[derive(Debug, Deserialize)]
struct NewOrder {
    item: String,
    quantity: i64,
}

const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS orders
    (id INTEGER PRIMARY KEY, account TEXT NOT NULL, item TEXT NOT NULL, quantity INTEGER NOT NULL)";

/// Inserts the order through the request's transaction.
#[idempotent(scope = "account")]
async fn create_order(
    Caller(account): Caller,
    mut tx: Transaction<Sqlite>,
    Json(req): Json<NewOrder>,
) -> Result<(StatusCode, Json<Value>), StatusCode> {
    // This row and the stored response commit together, in one SQLite commit, or neither
    // does: the order exists once per (account, key). An error is a 500, which rolls both
    // back, so a retry runs again.
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO orders (account, item, quantity) VALUES (?, ?, ?) RETURNING id",
    )
    .bind(account)
    .bind(&req.item)
    .bind(req.quantity)
    .fetch_one(&mut *tx)
    .await
    .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    let order = json!({"id": id, "item": req.item, "quantity": req.quantity});
    Ok((StatusCode::CREATED, Json(order)))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    // One pool for both: the store opens each request's transaction on it.
    let options = SqliteConnectOptions::from_str(&args.database)?
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(5));
    let db = SqlitePool::connect_with(options).await?;
    let store = SqliteStore::builder(db.clone()).build()?;
    store.migrate().await?;
    sqlx::query(SCHEMA).execute(&db).await?;
    let idempotency = Idempotency::new(store);
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
    idempotency.drain(Duration::from_secs(30)).await;
    Ok(())
}
