use idempotent_axum::idempotent;

#[idempotent(unscoped, ttl = "400d")]
async fn handler() {}

fn main() {}
