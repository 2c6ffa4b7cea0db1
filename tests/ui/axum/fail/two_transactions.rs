use idempotent_axum::sqlx::Postgres;
use idempotent_axum::{Transaction, idempotent};

#[idempotent(unscoped)]
async fn handler(a: Transaction<Postgres>, b: Transaction<Postgres>) -> &'static str {
    drop((a, b));
    "ok"
}

fn main() {}
