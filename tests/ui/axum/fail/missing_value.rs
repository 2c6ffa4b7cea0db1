use idempotent_axum::idempotent;

#[idempotent(unscoped, ttl)]
async fn handler() {}

fn main() {}
