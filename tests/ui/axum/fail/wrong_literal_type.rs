use idempotent_axum::idempotent;

#[idempotent(unscoped, ttl = 24)]
async fn handler() {}

fn main() {}
