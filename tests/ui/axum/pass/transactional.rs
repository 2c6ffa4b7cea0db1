//! Transactional handlers on axum: `Transaction<Postgres>` and `Transaction<Sqlite>`.

use axum::Json;
use axum::extract::Path;
use axum::routing::post;
use idempotent_axum::sqlx::{Postgres, Sqlite};
use idempotent_axum::{Transaction, idempotent};

#[idempotent(scope = "account")]
async fn single(
    Path(account): Path<String>,
    mut tx: Transaction<Postgres>,
    Json(v): Json<u32>,
) -> String {
    sqlx::query("INSERT INTO t (v) VALUES ($1)")
        .bind(i64::from(v))
        .execute(&mut *tx)
        .await
        .map(|_| account)
        .unwrap_or_default()
}

#[idempotent(scope = "account", commit = "two", wait = "5s")]
async fn two(mut tx: Transaction<Sqlite>, Path(account): Path<String>) -> Result<String, String> {
    sqlx::query("INSERT INTO t DEFAULT VALUES")
        .execute(&mut *tx)
        .await
        .map_err(|e| e.to_string())?;
    Ok(account)
}

#[idempotent(unscoped, commit = "single")]
async fn only_the_transaction(_tx: idempotent_axum::Transaction<Sqlite>) {}

fn main() {
    let _: axum::Router = axum::Router::new()
        .route("/a/{account}", post(single))
        .route("/b/{account}", post(two))
        .route("/c", post(only_the_transaction));
}
