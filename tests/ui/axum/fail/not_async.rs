use idempotent_axum::idempotent;

#[idempotent(unscoped)]
fn handler() {}

fn main() {}
