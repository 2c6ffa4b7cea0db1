use idempotent_axum::idempotent;

#[idempotent(unscoped, lease = "10ms")]
async fn handler() {}

fn main() {}
