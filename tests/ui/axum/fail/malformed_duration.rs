use idempotent_axum::idempotent;

#[idempotent(unscoped, ttl = "1.5h")]
async fn handler() {}

fn main() {}
