use idempotent_axum::idempotent;
use idempotent_axum::sqlx::{Postgres, Transaction};

#[idempotent(unscoped)]
async fn handler(tx: Transaction<'static, Postgres>) -> &'static str {
    drop(tx);
    "ok"
}

fn main() {}
