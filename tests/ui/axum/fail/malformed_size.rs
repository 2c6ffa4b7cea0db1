use idempotent_axum::idempotent;

#[idempotent(unscoped, max_response = "1MB")]
async fn handler() {}

fn main() {}
