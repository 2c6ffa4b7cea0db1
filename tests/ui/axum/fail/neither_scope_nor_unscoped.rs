use idempotent_axum::idempotent;

#[idempotent(ttl = "24h")]
async fn handler() {}

fn main() {}
