use idempotent_axum::idempotent;

#[idempotent(unscoped, key = "maybe")]
async fn handler() {}

fn main() {}
