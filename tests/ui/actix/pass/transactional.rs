//! Transactional handlers on actix: `Transaction<Postgres>` and `Transaction<Sqlite>` beside
//! path and JSON extractors.

use actix_web::web;
use idempotent_actix::sqlx::{Postgres, Sqlite};
use idempotent_actix::{Transaction, idempotent};

#[idempotent(scope = "account.0")]
async fn single(
    account: web::Path<(String,)>,
    mut tx: Transaction<Postgres>,
    body: web::Json<u32>,
) -> String {
    let _ = sqlx::query("INSERT INTO t (v) VALUES ($1)")
        .bind(i64::from(*body))
        .execute(&mut *tx)
        .await;
    account.into_inner().0
}

#[idempotent(unscoped, commit = "two", wait = "1s")]
async fn two(mut tx: Transaction<Sqlite>) -> actix_web::Result<String> {
    sqlx::query("INSERT INTO t DEFAULT VALUES")
        .execute(&mut *tx)
        .await
        .map_err(actix_web::error::ErrorInternalServerError)?;
    Ok("ok".into())
}

fn main() {
    let _ = actix_web::App::new()
        .route("/a/{account}", web::post().to(single))
        .route("/b", web::post().to(two));
}
