use idempotent_axum::idempotent;

struct Api;

impl Api {
    #[idempotent(unscoped)]
    async fn handler(&self) {}
}

fn main() {}
