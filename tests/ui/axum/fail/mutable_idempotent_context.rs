use idempotent_axum::{Idempotent, idempotent};

#[idempotent(unscoped)]
async fn handler(idem: &mut Idempotent) -> String {
    idem.derive("payment-provider").to_string()
}

fn main() {}
