use idempotent_axum::idempotent;

#[idempotent(unscoped, ttl = "1h", ttl = "2h")]
async fn handler() {}

fn main() {}
