use idempotent_axum::{Idempotent, idempotent};

#[idempotent(unscoped)]
async fn handler(a: Idempotent, b: &Idempotent) -> String {
    format!("{:?} {:?}", a, b)
}

fn main() {}
