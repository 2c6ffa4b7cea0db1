use idempotent_axum::idempotent;

#[idempotent(unscoped, lease = "0s")]
async fn handler() {}

fn main() {}
