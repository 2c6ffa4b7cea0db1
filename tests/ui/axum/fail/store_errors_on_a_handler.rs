use idempotent_axum::idempotent;

#[idempotent(unscoped, store_errors)]
async fn handler() -> &'static str {
    "ok"
}

fn main() {}
