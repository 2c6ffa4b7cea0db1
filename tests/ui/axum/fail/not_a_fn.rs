use idempotent_axum::idempotent;

#[idempotent(unscoped)]
struct Handler;

fn main() {}
