use idempotent_axum::idempotent;

#[idempotent(unscoped)]
const fn handler() {}

fn main() {}
