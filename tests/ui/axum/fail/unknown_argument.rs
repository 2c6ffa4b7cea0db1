use idempotent_axum::idempotent;

#[idempotent(unscoped, colour = "red")]
async fn handler() {}

fn main() {}
