use idempotent_axum::idempotent;

#[idempotent(unscoped = "yes")]
async fn handler() {}

fn main() {}
