//! `Idempotent` taken owned or borrowed, with derived keys, beside a transaction.

use axum::extract::Path;
use axum::routing::post;
use idempotent_axum::sqlx::Postgres;
use idempotent_axum::{Idempotent, Transaction, idempotent};

#[idempotent(scope = "account")]
async fn owned(Path(account): Path<String>, idem: Idempotent) -> String {
    format!("{account} {}", idem.derive("payment-provider"))
}

#[idempotent(scope = "account")]
async fn borrowed(idem: &Idempotent, Path(account): Path<String>) -> String {
    let key: idempotent_axum::DerivedKey = idem.derive("email");
    format!("{account} {key}")
}

#[idempotent(scope = "account")]
async fn with_a_transaction(
    mut tx: Transaction<Postgres>,
    idem: idempotent_axum::Idempotent,
    Path(account): Path<String>,
) -> String {
    let key = idem.derive("payment-provider").to_string();
    sqlx::query("INSERT INTO t (k) VALUES ($1)")
        .bind(&key)
        .execute(&mut *tx)
        .await
        .map(|_| account)
        .unwrap_or_default()
}

mod actix {
    use actix_web::{HttpResponse, web};
    use idempotent_actix::{Idempotent, idempotent};

    #[idempotent(unscoped)]
    pub async fn charge(body: web::Bytes, idem: Idempotent) -> HttpResponse {
        HttpResponse::Ok().body(format!(
            "{} {}",
            body.len(),
            idem.derive("payment-provider")
        ))
    }
}

fn main() {
    let _: axum::Router = axum::Router::new()
        .route("/a/{account}", post(owned))
        .route("/b/{account}", post(borrowed))
        .route("/c/{account}", post(with_a_transaction));
    let _ = actix_web::App::new().route("/d", actix_web::web::post().to(actix::charge));
}
