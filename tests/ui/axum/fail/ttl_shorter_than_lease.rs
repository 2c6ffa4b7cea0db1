use idempotent_axum::idempotent;

#[idempotent(unscoped, ttl = "1m", lease = "5m")]
async fn handler() {}

fn main() {}
